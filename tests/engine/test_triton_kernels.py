"""The Triton kernels (engine/triton_ops), run interpreted on the CPU (TRITON_INTERPRET=1, set
by tests/conftest.py when there is no GPU) against independent references: dense
scaled_dot_product_attention on K/V gathered from the cache slot by slot, plain indexing for
the KV write and pack/unpack. Inputs are fresh random values; every cache position a sequence
does not own is NaN, and outputs are NaN before the call, so a kernel that reads a wrong slot
or skips a row fails. Each test also checks that the kernel really launched.

Error: ||out - ref|| / ||ref||, the reference computed in float32 from the same inputs. Bounds
(engine/triton_ops/reference.py): float32 1e-5 (IEEE products), float16 2e-3, bfloat16 1.5e-2
(the probabilities are rounded to the value dtype before the P·V product, as on the GPU).
Measured here: float32 ~1e-7, float16 ~3e-4, bfloat16 ~3e-3.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.triton_ops import LAUNCHES, TritonUnavailable
from engine.triton_ops.kv_pack import pack_kv_blocks, unpack_kv_blocks
from engine.triton_ops.kv_write import write_kv
from engine.triton_ops.paged_decode import paged_decode_attention
from engine.triton_ops.paged_prefill import paged_prefill_attention
from engine.triton_ops.reference import (
    ERROR_BOUND,
    PagedCache,
    decode_reference,
    prefill_reference,
    rel_error,
)

BOUND = ERROR_BOUND
ROOT = Path(__file__).parents[2]


def context_lengths(batch: int, block_size: int, rng: random.Random, longest: int = 200) -> list[int]:
    """Lengths that are and are not multiples of the block size (1 and exact multiples included)."""
    picks = [1, block_size, 3 * block_size, block_size + 1, 2 * block_size - 1]
    return [picks[i] if i < len(picks) and i < batch - 1 else rng.randrange(1, longest) for i in range(batch)]


DECODE_CASES = [  # (head_dim, query heads per KV head, block_size, dtype, batch, splits)
    (64, 1, 16, torch.float32, 1, 1),
    (64, 4, 16, torch.float16, 5, 1),
    (64, 8, 32, torch.bfloat16, 16, 1),
    (128, 1, 32, torch.bfloat16, 3, 1),
    (128, 8, 16, torch.float32, 8, 1),
    (128, 3, 16, torch.float16, 4, 1),
    (64, 4, 32, torch.float32, 6, 2),
    (128, 8, 16, torch.bfloat16, 2, 4),
    (64, 2, 16, torch.float16, 16, 3),
]


def _run_decode(head_dim, group, block_size, dtype, batch, splits, seed, longest=200):
    rng = random.Random(seed)
    num_kv_heads = 2
    lens = context_lengths(batch, block_size, rng, longest)
    paged = PagedCache(lens, block_size, num_kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    out = torch.full_like(query, float("nan"))
    kernels = ("paged_decode",) if splits == 1 else ("paged_decode_split", "paged_decode_reduce")
    before = {k: LAUNCHES[k] for k in kernels}
    result = paged_decode_attention(query, paged.cache, paged.table_tensor(pad=1),
                                    torch.tensor(lens, dtype=torch.int32), out=out, num_splits=splits)
    assert result is out and all(LAUNCHES[k] == before[k] + 1 for k in kernels)
    assert not torch.isnan(out).any()
    error = rel_error(out, decode_reference(query, paged))
    assert error < BOUND[dtype], f"relative error {error:.2e} over {BOUND[dtype]:.0e} (lens {lens})"


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("head_dim,group,block_size,dtype,batch,splits", DECODE_CASES,
                         ids=[f"d{c[0]}-g{c[1]}-bs{c[2]}-{_name(c[3])}-b{c[4]}-s{c[5]}" for c in DECODE_CASES])
def test_paged_decode_matches_dense_attention(head_dim, group, block_size, dtype, batch, splits):
    _run_decode(head_dim, group, block_size, dtype, batch, splits, seed=head_dim + group + batch + splits)


@pytest.mark.slow
@pytest.mark.parametrize("group", range(1, 9))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_paged_decode_sweep(group, head_dim, block_size, splits):
    for dtype in BOUND:
        _run_decode(head_dim, group, block_size, dtype, 16, splits, seed=group * 7 + splits, longest=1000)


PREFILL_CASES = [  # (head_dim, group, block_size, dtype, [(chunk length, cached prefix length)])
    (64, 1, 16, torch.float32, [(37, 0)]),
    (64, 4, 16, torch.float16, [(5, 0), (33, 17), (1, 19), (16, 32)]),
    (128, 8, 32, torch.bfloat16, [(20, 44), (9, 0)]),
    (128, 2, 16, torch.float32, [(40, 1), (3, 60)]),
    (64, 8, 32, torch.bfloat16, [(17, 0), (32, 32), (2, 5)]),
    (64, 3, 16, torch.float16, [(24, 8)]),
]


def _run_prefill(head_dim, group, block_size, dtype, chunks, seed):
    num_kv_heads = 2
    lens = [q_len + prefix for q_len, prefix in chunks]
    paged = PagedCache(lens, block_size, num_kv_heads, head_dim, dtype, seed)
    cu = [0]
    for q_len, _ in chunks:
        cu.append(cu[-1] + q_len)
    query = torch.randn(cu[-1], num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = torch.full_like(query, float("nan"))
    before = LAUNCHES["paged_prefill"]
    paged_prefill_attention(query, paged.cache, paged.table_tensor(torch.int64, pad=2),
                            torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                            max(q for q, _ in chunks), out=out)
    assert LAUNCHES["paged_prefill"] == before + 1
    assert not torch.isnan(out).any()
    error = rel_error(out, prefill_reference(query, cu, paged))
    assert error < BOUND[dtype], f"relative error {error:.2e} over {BOUND[dtype]:.0e} (chunks {chunks})"


@pytest.mark.parametrize("head_dim,group,block_size,dtype,chunks", PREFILL_CASES,
                         ids=[f"d{c[0]}-g{c[1]}-bs{c[2]}-{_name(c[3])}-n{len(c[4])}" for c in PREFILL_CASES])
def test_chunked_prefill_over_paged_kv_matches_dense_causal_attention(head_dim, group, block_size, dtype, chunks):
    _run_prefill(head_dim, group, block_size, dtype, chunks, seed=len(chunks) * 31 + head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 2, 5, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_sweep(group, head_dim, block_size):
    rng = random.Random(group * head_dim + block_size)
    chunks = [(rng.randrange(1, 150), rng.choice([0, rng.randrange(1, 300)])) for _ in range(8)]
    for dtype in BOUND:
        _run_prefill(head_dim, group, block_size, dtype, chunks, seed=group)


@pytest.mark.parametrize("dtype", list(BOUND), ids=_name)
def test_kv_write_scatters_rows_by_slot_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(9, 16, 4, 64, generator=gen).to(dtype)
    expected = cache.clone()
    qkv = torch.randn(7, 8, 64, generator=gen).to(dtype)  # a fused projection: K/V are a strided view
    key_value = qkv[:, 4:]
    slots = torch.tensor([3, 17, 143, -1, 40, 41, 0])
    before = LAUNCHES["kv_write"]
    write_kv(key_value, cache, slots)
    assert LAUNCHES["kv_write"] == before + 1
    keep = slots >= 0
    expected.flatten(0, 1)[slots[keep]] = key_value[keep]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_kv_pack_and_unpack_move_whole_blocks_over_a_layer_range(dtype):
    gen = torch.Generator().manual_seed(5)
    storage = torch.randn(5, 12, 16, 4, 64, generator=gen).to(dtype)
    ids = torch.tensor([7, 2, 11, 0], dtype=torch.int32)
    packed = pack_kv_blocks(storage, ids, 1, 4)
    assert packed.is_contiguous() and torch.equal(packed, storage[1:4][:, ids.long()])
    receiver = torch.full_like(storage, float("nan"))
    targets = torch.tensor([1, 5, 3, 9])
    before = LAUNCHES["kv_unpack"]
    unpack_kv_blocks(packed, receiver, targets, 1)
    assert LAUNCHES["kv_unpack"] == before + 1
    assert torch.equal(receiver[1:4][:, targets], storage[1:4][:, ids.long()])
    untouched = torch.ones(receiver.shape[:2], dtype=torch.bool)
    untouched[1:4, targets] = False
    assert torch.isnan(receiver[untouched]).all()  # nothing else written


def test_kv_cache_pack_blocks_on_the_cpu_equals_the_kernel():
    from types import SimpleNamespace

    from engine.kv_cache.kv_cache import KVCache

    arch = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=32)  # what KVCache reads
    cache = KVCache(arch, num_blocks=8, block_size=16, dtype=torch.float32)
    cache.storage.copy_(torch.randn(cache.storage.shape))
    assert cache.layers[1].data_ptr() == cache.storage[1].data_ptr()  # layers are views of one tensor
    packed = cache.pack_blocks([5, 1], 0, 3)
    assert torch.equal(packed, pack_kv_blocks(cache.storage, torch.tensor([5, 1]), 0, 3))
    other = KVCache(arch, num_blocks=8, block_size=16, dtype=torch.float32)
    other.unpack_blocks(packed, [2, 6], 0)
    assert torch.equal(other.layers[2][6], cache.layers[2][1])


def test_launchers_refuse_bad_shapes_dtypes_and_strides():
    cache = torch.randn(4, 16, 4, 64)
    query = torch.randn(2, 4, 64)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.randn(2, 3, 64), cache, tables, lens)
    with pytest.raises(ValueError, match="share a supported dtype"):
        paged_decode_attention(query.half(), cache, tables, lens)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(torch.randn(2, 4, 32), cache, tables, lens)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_decode_attention(query, cache, tables.float(), lens)
    with pytest.raises(ValueError, match="one row"):
        paged_decode_attention(query, cache, tables[:1], lens)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        paged_decode_attention(torch.randn(2, 64, 4).transpose(1, 2), cache, tables, lens)
    with pytest.raises(ValueError, match="block_size"):
        paged_decode_attention(query, torch.randn(4, 12, 4, 64), tables, lens)
    with pytest.raises(ValueError, match="contiguous within each slot"):
        paged_decode_attention(query, torch.randn(4, 16, 64, 4).transpose(2, 3), tables, lens)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(query, cache, tables, lens, torch.tensor([0, 1], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="slots for"):
        write_kv(torch.randn(3, 4, 64), cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="layer range"):
        pack_kv_blocks(torch.randn(2, 4, 16, 4, 64), torch.tensor([0]), 1, 3)


def test_triton_where_it_cannot_run_is_a_loud_error(monkeypatch):
    from engine.attention import make_attention_backend
    from engine.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter: Triton cannot run
    with pytest.raises(TritonUnavailable, match="need a CUDA device"):
        make_attention_backend("triton", "cpu", torch.float32)
    with pytest.raises(TritonUnavailable, match="need a CUDA device"):
        paged_decode_attention(torch.randn(1, 2, 64), torch.randn(2, 16, 4, 64), torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32))
    assert isinstance(make_attention_backend("auto", "cpu", torch.float32), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention_backend("flash", "cpu", torch.float32)


def test_the_engine_device_is_chosen_explicitly_and_checked():
    from engine.attention import make_attention_backend
    from engine.platform import resolve_device

    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not supported"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="torch attention backend runs on the CPU"):
        make_attention_backend("torch", "cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_prompts():
    rng = random.Random(11)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in (3, 17, 40, 75)]


@pytest.mark.parametrize("splits", [1, 2])
def test_generation_with_the_triton_backend_equals_the_torch_backend(tiny_llama_dir, tiny_prompts, monkeypatch,
                                                                     splits):
    """The tiny model end to end (chunked prefill with a token budget below the prompts, a shared
    prefix from the prefix cache, then decodes), interpreted Triton against torch: the same tokens."""
    from engine import LLM, SamplingParams
    from engine.triton_ops import paged_decode

    monkeypatch.setattr(paged_decode, "choose_num_splits", lambda *args: splits)  # split-K in the engine too
    prompts = tiny_prompts + [tiny_prompts[3][:64] + [7, 8, 9]]  # four cached blocks of prompt 4, then new tokens
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", attention_backend=backend, num_kv_blocks=64,
                  max_model_len=256, max_num_batched_tokens=48, num_threads=1)
        before = dict(LAUNCHES)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)]
        tokens[backend] += [o.outputs[0].token_ids for o in llm.generate(prompts[4:], params)]
        launched = {k: LAUNCHES[k] - before.get(k, 0) for k in LAUNCHES}
        if backend == "triton":
            decode_kernel = "paged_decode" if splits == 1 else "paged_decode_split"
            assert launched["paged_prefill"] > 0 and launched[decode_kernel] > 0 and launched["kv_write"] > 0
        else:
            assert not any(launched.values())  # the torch backend launches no Triton kernel
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 10 for t in tokens["torch"])


def test_disaggregated_prefill_on_the_triton_backend(tiny_llama_dir, tiny_prompts):
    """A prefill engine on the Triton backend exports a prompt whose first blocks it has cached:
    those leave in one kv_pack launch covering every layer, the rest layer by layer, and a
    decode engine on the torch backend then generates what a colocated torch engine does."""
    from engine import SamplingParams
    from kv_transfer.inprocess import InProcessKVSink
    from tests.conftest import make_llm
    from tests.kv_transfer.helpers import RecordsSent, disaggregated

    class Recorder(RecordsSent, InProcessKVSink):
        pass

    kwargs = dict(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, num_threads=1)
    prompt = tiny_prompts[3]  # 75 tokens
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = make_llm(attention_backend="torch", **kwargs).generate({"prompt_token_ids": prompt}, params)
    prefill = make_llm(attention_backend="triton", **kwargs).engine_core
    decode = make_llm(attention_backend="torch", **kwargs).engine_core
    assert prefill.kv_cache.triton and not decode.kv_cache.triton
    prefill.add_request(prefill.make_request("warm", prompt[:64] + [5, 6], params))  # caches 4 blocks of the prompt
    while prefill.has_unfinished_requests():
        prefill.step()
    before = LAUNCHES["kv_pack"]
    sink = Recorder(decode)
    tokens, _ = disaggregated(prefill, decode, [prompt], params, sink, tag="tri")
    assert LAUNCHES["kv_pack"] == before + 1
    layers = decode.config.model.arch.num_hidden_layers
    assert [(start, len(kv)) for _, _, start, kv in sink.sent] == [(0, 64)] * layers + [(64, 11)] * layers
    assert tokens["tri0"] == expected[0].outputs[0].token_ids


def test_kernels_pass_with_the_triton_that_pytorch_cuda_builds_ship():
    """Triton 3.6 (what PyTorch's CUDA wheels pin) next to the one `make test` installs: a
    representative case of every kernel, run with that Triton in a child process. `make tools`
    puts numpy 2.2 beside it: 3.6's interpreter calls int() on 1-element arrays, which numpy 2.3
    and later refuse (an interpreter matter; compiled kernels never see numpy)."""
    older = Path(os.environ.get("TANDEM_TRITON_36", ROOT / ".venv-tools" / "triton-3.6"))
    assert (older / "triton").is_dir(), f"{older} is missing: run `make tools`"
    selection = ("d64-g4-bs16-float16-b5-s1 or d128-g8-bs16-bfloat16-b2-s4 or d128-g8-bs32-bfloat16-n2 or "
                 "test_kv_write and float16 or test_kv_pack and bfloat16 or test_launchers or test_which_triton")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(older), str(ROOT)]), "TRITON_INTERPRET": "1",
           "TANDEM_EXPECT_TRITON": "3.6"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection,
                             "-m", "not slow"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "triton 3.6" in result.stdout and "8 passed" in result.stdout, result.stdout[-2000:]


def test_the_gpu_check_script_runs_interpreted_with_only_torch_and_triton():
    """bench/gpu_kernels.py --smoke: the script a GPU session runs, checked end to end here on
    tiny shapes, importing nothing of tandem's but the kernels."""
    code = ("import runpy, sys\n"
            "sys.argv = ['gpu_kernels.py', '--smoke']\n"
            "try:\n    runpy.run_path('bench/gpu_kernels.py', run_name='__main__')\n"
            "except SystemExit as exc:\n    code = exc.code\n"
            "extra = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'ray', 'fastapi', 'grpc')"
            " or m in ('engine.llm', 'engine.engine_core'))\n"
            "print('EXTRA IMPORTS', extra)\n"
            "sys.exit(code or (1 if extra else 0))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "EXTRA IMPORTS []" in result.stdout and "FAIL" not in result.stdout
    assert result.stdout.count("| ok |") == 12 and "paged decode bf16" in result.stdout and "KV unpack" in result.stdout
    assert result.stdout.count("\n|---") == 1  # one table


def test_the_gpu_scripts_split_sweep_times_every_count_and_names_the_fastest():
    """--split-sweep (what places choose_num_splits's threshold on a GPU), here interpreted: one row
    per (batch, context), a time for every split count, the fastest named, and the heuristic's
    choice (1 off CUDA)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "bench" / "gpu_kernels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls = []

    def bench(fn):  # counts the calls and times them like the script's own wall-clock bench
        calls.append(fn)
        return script._wall_clock_bench(fn, repeats=1)

    rows = script.time_split_sweep("cpu", bench, (1, 2), (64,), splits=(1, 2, 4))
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 64), (2, 64)] and len(calls) == 6
    for row in rows:
        assert set(row["ms"]) == {"1", "2", "4"} and row["chosen"] == 1
        assert row["ms"][str(row["best"])] == min(row["ms"].values())


def test_the_gpu_script_judges_the_targets_against_the_copy():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "bench" / "gpu_kernels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    copy = 4e12  # bytes per second
    decode = [{"batch": 64, "context": 4096, "ms": 1.0, "bandwidth": 0.69 * copy, "ms_single_pass": 1.2,
               "bandwidth_single_pass": 0.5 * copy}]
    pack = [{"kernel": "pack", "tokens": 4096, "layers": 32, "ms": 0.1, "bandwidth": 0.81 * copy},
            {"kernel": "unpack", "tokens": 4096, "layers": 32, "ms": 0.1, "bandwidth": 0.79 * copy}]
    table = "\n".join(script.render_table([("decode", 1e-3, 2e-3), ("prefill", 3e-3, 2e-3)], copy, 1 << 30, decode,
                                          pack))
    assert ">= 70%: MISSED" in table and "| 69% |" in table
    assert table.count(">= 80%: met") == 1 and table.count(">= 80%: MISSED") == 1
    assert table.count("| ok |") == 1 and table.count("| FAIL |") == 1


def test_which_triton_runs_these_tests(capsys):
    """The one `make test` pins (constraints.txt), unless the 3.6 run above says otherwise."""
    import re

    import triton

    pinned = re.search(r"^triton==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    expected = os.environ.get("TANDEM_EXPECT_TRITON", pinned)
    with capsys.disabled():
        print(f"\ntriton {triton.__version__}")
    assert triton.__version__.startswith(expected), (triton.__version__, expected)


def test_warm_up_compiles_the_common_kernels_and_leaves_no_trace(tiny_llama_dir, tiny_prompts):
    """What a worker runs before it says it is ready: prefill, KV write and decode kernels launch
    (on a GPU, that is when they compile); afterwards no block is held or cached, the counters
    are zero, and the engine generates what a fresh one does."""
    from engine import SamplingParams
    from tests.conftest import make_llm

    kwargs = dict(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, num_threads=1,
                  attention_backend="triton")
    llm = make_llm(**kwargs)
    core = llm.engine_core
    before = dict(LAUNCHES)
    core.warm_up()
    launched = {k: LAUNCHES[k] - before.get(k, 0) for k in LAUNCHES}
    layers = core.config.model.arch.num_hidden_layers  # one prefill step, one decode step: a launch per layer each
    assert launched["paged_prefill"] == launched["paged_decode"] == layers and launched["kv_write"] == 2 * layers
    assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
    assert core.block_pool.num_cached_blocks == 0
    assert core.counters.num_prompt_tokens_computed == core.counters.num_generation_tokens == 0
    assert core.runner.num_forward_calls == 0
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    warmed = [o.outputs[0].token_ids for o in llm.generate([tiny_prompts[1], tiny_prompts[2]], params)]
    fresh = make_llm(**kwargs).generate([tiny_prompts[1], tiny_prompts[2]], params)
    assert warmed == [o.outputs[0].token_ids for o in fresh]


def test_the_gpu_engine_check_runs_on_the_cpu(smollm_dir, tmp_path):
    """bench/gpu_engine.py --smoke: the engine check a GPU session runs (the engine with Triton
    attention against transformers, float32 to the token), end to end here on a tiny model with
    the kernels interpreted. A token that differs from transformers' makes it exit 1."""
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_dir / name).write_bytes((smollm_dir / name).read_bytes())
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "bench/gpu_engine.py", "--smoke", "--tokenizer-dir", str(tokenizer_dir),
                             "--work-dir", str(tmp_path / "models"), "--json", str(report)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    tiny = json.loads(report.read_text())["shapes"]["tiny"]
    assert "error" not in tiny
    tokens = tiny["tokens_float32"]
    assert tokens["identical"] == tokens["sequences"] == 8 and tokens["prefix_cache_hit_tokens"] == 2 * 64
    assert tiny["bf16_top1"]["positions"] == 8 * 8
    assert tiny["speed"]["tandem"]["batch_tok_s"] > 0 and tiny["speed"]["transformers"]["batch_tok_s"] > 0
    assert "tokens float32 vs transformers | 8/8 identical over 8 tokens (met)" in result.stdout


def test_the_gpu_engine_check_marks_a_float32_difference_missed():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_engine", ROOT / "bench" / "gpu_engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokens = {"identical": 2, "sequences": 3, "tokens_each": 4, "agreed_before_first_difference": [4, 4, 1]}
    report = {"device": "x", "torch": "t", "triton": "3", "shapes": {"m": {"tokens_float32": tokens}}}
    assert "2/3 identical over 4 tokens (MISSED)" in script.render(report)
    assert script.agreed([1, 2, 3], [1, 2, 4]) == 2 and script.agreed([1, 2], [1, 2]) == 2
