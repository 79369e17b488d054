"""KV transfer: how a prompt's KV cache travels from a prefill engine to a decode engine.

Transports implement ``engine.remote_kv.KVSink`` on the sending side and call
``EngineCore.write_remote_kv`` / ``finish_remote_kv`` on the receiving side.
"""
