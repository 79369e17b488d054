"""KV transfer: how a prompt's KV cache travels from a prefill engine to a decode engine.

The protocol is ``wire`` (frames: a protobuf header and the tensor's raw bytes) and
``session`` (the sender's queue of typed items behind the engine's ``KVSink``, and the
receiver's ``ReceiveSession`` behind ``KVReceiver``, which validates a stream into the
engine's ``inbox``). The transports only move bytes: ``grpc_transport`` (Push streams, any
network), ``torch_dist`` (torch.distributed pairs: NCCL on GPUs, gloo on CPUs) and
``inprocess`` (the unit tests' twin).
"""
