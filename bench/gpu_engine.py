"""The GPU check of tandem's engine, end to end, in one command that needs torch, triton,
transformers, safetensors, tokenizers and jinja2 (no Ray, no Redis, no model download):

    python bench/gpu_engine.py --tokenizer-dir DIR           # on a machine with a CUDA GPU
    python bench/gpu_engine.py --tokenizer-dir DIR --smoke   # anywhere: tiny shapes, on the CPU

DIR holds a tokenizer.json and tokenizer_config.json (SmolLM2's: `tandem models fetch` puts
them in the model directory). The weights are random, written by transformers itself, in the
shapes named below, so the check needs no hub.

1. Tokens: the engine on the device (`device="cuda"`, Triton attention) against Hugging Face
   transformers on the same device, same weights, greedy. float32 must match to the token (TF32
   off on both sides): prompts of 5 to 700 tokens, chunked prefill (a 256-token step budget),
   a second wave that hits the prefix cache, and a batch of 16 decoding together. bfloat16 is
   reported (how many tokens agree before the first difference), not judged: two bf16
   implementations that sum in different orders part ways on near-ties.
2. The KV cache sized from `gpu_memory_utilization`: the blocks it got, and the memory left.
3. Speed in bfloat16, against transformers' `generate` on the same GPU in the same run, and
   against tandem itself with --enforce-eager (no decode graphs):
   - a batch of 64 requests of 250 prompt tokens and 128 output tokens (output tokens/s);
   - one request alone (ms per output token after the first).
4. The sampler on the device against the same logits on the CPU: the same token in every row.
5. A worker's engine thread (EngineLoop): built, warmed up and stepped on its own thread, with
   requests added from another while others decode; each gets the tokens it gets alone.
It prints one table and, with --json, writes the figures to a file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 49152  # SmolLM2's tokenizer
# (name, hidden, intermediate, layers, heads, kv heads): SmolLM2-135M's shape, and a 1B-class
# Llama shape (Llama-3.2-1B's attention and MLP, SmolLM2's vocabulary)
SHAPES = {
    "smollm2-135m-shape": (576, 1536, 30, 9, 3),
    "llama-1b-shape": (2048, 8192, 16, 32, 8),
}
SMOKE_SHAPES = {"tiny": (64, 160, 3, 4, 2)}


def write_checkpoint(directory: Path, tokenizer_dir: Path, shape: tuple, seed: int, device: str) -> None:
    import transformers

    hidden, intermediate, layers, heads, kv_heads = shape
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        initializer_range=0.1,  # wider than the default 0.02: random logits otherwise nearly tie
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    with torch.device(device):  # initialising a billion parameters on the CPU takes a minute
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # RMSNorm weights default to ones; perturb so they are really read
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)


def prompts_for(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompts: list[list[int]], max_new: int, device: str) -> list[list[int]]:
    """One prompt at a time (no padding), greedy, as the token reference."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             min_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def agreed(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def load_hf(directory: Path, dtype: torch.dtype, device: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="eager").to(device).eval()


def check_tokens(directory: Path, device: str, dtype: torch.dtype, smoke: bool) -> dict:
    from engine import LLM, SamplingParams

    max_new = 8 if smoke else 24
    first = prompts_for([5, 37, 70] if smoke else [5, 37, 300, 700], seed=1)
    # a second wave sharing the third prompt's first blocks: prefix-cache hits
    shared = 64 if smoke else 288
    second = [first[2][:shared] + p for p in prompts_for([20, 3], seed=2)]
    batch = prompts_for([24 + 7 * i for i in range(3)] if smoke else [64 + 7 * i for i in range(16)], seed=3)
    # the step budget cuts the longest prompt into chunks
    llm = LLM(model=str(directory), dtype=dtype, device=device, attention_backend="triton",
              num_kv_blocks=1024, max_model_len=1024, max_num_batched_tokens=32 if smoke else 256, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    ours, hits = [], 0
    for wave in (first, second, batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in wave], params)
        ours += [out.outputs[0].token_ids for out in outs]
        hits += sum(out.num_cached_tokens for out in outs) if wave is second else 0
    graphs = llm.engine_core.runner.decode_graphs
    replays = graphs.num_replays if graphs is not None else 0
    del llm
    hf = load_hf(directory, dtype, device)
    with torch.no_grad():
        theirs = hf_greedy(hf, first + second + batch, max_new, device)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    agree = [agreed(list(a), b) for a, b in zip(ours, theirs)]
    result = {"dtype": str(dtype).removeprefix("torch."), "sequences": len(ours), "tokens_each": max_new,
              "identical": sum(a == max_new for a in agree), "agreed_before_first_difference": agree,
              "prefix_cache_hit_tokens": hits, "decode_graph_replays": replays}
    return result, first + second + batch, theirs


def check_bf16_against_float32(directory: Path, device: str, prompts: list[list[int]],
                               continuations: list[list[int]]) -> dict:
    """Teacher-forced: each prompt followed by float32 transformers' greedy continuation is read
    once in bfloat16; at each continuation position, is the bf16 model's top token the float32
    one? Judged for tandem (prompt_logprobs: the rank-1 token) and for transformers alike, so a
    bf16 difference of tandem's own shows as a lower share than transformers'."""
    from engine import LLM, SamplingParams

    sequences = [p + list(c) for p, c in zip(prompts, continuations)]
    llm = LLM(model=str(directory), dtype=torch.bfloat16, device=device, attention_backend="triton",  # each read whole
              num_kv_blocks=1024, max_model_len=1024, max_num_batched_tokens=256, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    ours = 0
    for out, prompt, continuation in zip(outs, prompts, continuations):
        for token, position in zip(continuation, out.prompt_logprobs[len(prompt):]):
            ours += position[token].rank == 1
    del llm
    hf = load_hf(directory, torch.bfloat16, device)
    theirs = 0
    with torch.no_grad():
        for sequence, prompt, continuation in zip(sequences, prompts, continuations):
            logits = hf(torch.tensor([sequence], device=device)).logits[0, len(prompt) - 1:-1]
            theirs += int((logits.argmax(-1).cpu() == torch.tensor(continuation)).sum())
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    positions = sum(len(c) for c in continuations)
    return {"positions": positions, "tandem": ours / positions, "transformers": theirs / positions}


def check_sampler(device: str) -> dict:
    """Sampling where the logits are (the GPU) against the same logits on the CPU: every kind of
    row (greedy; seeded draws under temperature, top-k, top-p and min-p; penalties; min_tokens;
    logprobs) must pick the same token, and the logprobs must agree."""
    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams
    from engine.scheduler_types import SamplingInput

    kinds = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.8, seed=1),
             SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=2, logprobs=2),
             SamplingParams(temperature=0.7, min_p=0.05, seed=3),
             SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
             SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[7])]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4 * len(kinds), VOCAB, generator=generator) * 4
    inputs = [SamplingInput(kinds[row % len(kinds)], seed=row, position=10 + row, prompt_token_ids=[5, 6, 7],
                            output_token_ids=[7, 8], eos_token_ids=(2,)) for row in range(len(logits))]
    logits[:, 7] = logits.max() + 1  # the stop token would win where min_tokens does not block it
    cpu = Sampler()(logits.clone(), inputs)
    ours = Sampler()(logits.to(device), inputs)
    same = sum(a.token_id == b.token_id for a, b in zip(cpu, ours))
    worst = 0.0
    for a, b in zip(cpu, ours):
        if a.logprobs is not None:
            assert a.logprobs.token_ids == b.logprobs.token_ids
            worst = max(worst, *(abs(x - y) for x, y in zip(a.logprobs.logprobs, b.logprobs.logprobs)))
    return {"rows": len(inputs), "same_token": same, "max_logprob_difference": worst}


def check_engine_loop(directory: Path, device: str, smoke: bool) -> dict:
    """A worker's engine thread (engine/engine_loop.py): it builds the core and warms it up there
    (on a GPU: the decode graphs are captured on that thread), then serves requests added from
    this thread while others are decoding, some greedy and some seeded draws. Each request's
    tokens must equal what ``LLM.generate`` gives for it alone on the same device."""
    import threading

    from engine import LLM, SamplingParams
    from engine.engine_loop import AddRequest, EngineLoop, build_engine
    from engine.llm import EngineArgs

    kwargs = dict(model=str(directory), dtype=torch.float32, device=device, num_kv_blocks=1024, max_model_len=1024,
                  max_num_seqs=16, seed=0)
    prompts = prompts_for([9 + 13 * i for i in range(12)], seed=4)
    max_new = 6 if smoke else 20
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, top_p=0.95, seed=i, max_tokens=max_new,
                             ignore_eos=True) for i in range(len(prompts))]
    loop = EngineLoop(lambda: build_engine(EngineArgs(**kwargs)))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)

    def listener_for(index):
        def listen(output):
            tokens[index].extend(output.new_token_ids)
            if output.finish_reason:
                done.release()
        return listen

    loop.start()
    try:
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            loop.add(AddRequest(f"loop-{index}", prompt, param, listener_for(index))).result(60)
            time.sleep(0.002 * (index % 3))  # requests join while others decode
        finished = sum(done.acquire(timeout=120) for _ in prompts)
        graphs = loop.core.runner.decode_graphs
        replays = graphs.num_replays if graphs is not None else 0
    finally:
        loop.stop()
    del loop
    llm = LLM(**kwargs)
    alone = [llm.generate([{"prompt_token_ids": p}], param)[0].outputs[0].token_ids
             for p, param in zip(prompts, params)]
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    same = sum(tokens[i] == list(alone[i]) for i in range(len(prompts)))
    return {"requests": len(prompts), "finished": finished, "same_as_alone": same, "decode_graph_replays": replays}


def check_capture_failure(directory: Path, device: str) -> dict:
    """A decode graph whose capture fails on the device (here: the first capture meets a device
    synchronisation, which CUDA refuses while a stream captures) leaves that size eager; the
    engine goes on, and its tokens equal an --enforce-eager engine's."""
    from engine import LLM, SamplingParams

    if device != "cuda":
        return {}
    kwargs = dict(model=str(directory), dtype=torch.float32, device=device, num_kv_blocks=1024, max_model_len=1024,
                  max_num_seqs=16, seed=0)
    requests = [{"prompt_token_ids": p} for p in prompts_for([20, 45, 70], seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs, enforce_eager=True).generate(requests, params)]
    llm = LLM(**kwargs)
    model, forward, tripped = llm.engine_core.model, llm.engine_core.model.forward, []

    def forward_that_syncs_once_while_capturing(*args, **kw):
        if torch.cuda.is_current_stream_capturing() and not tripped:
            tripped.append(True)
            torch.cuda.synchronize()  # not permitted during a capture: this capture fails
        return forward(*args, **kw)

    model.forward = forward_that_syncs_once_while_capturing
    ours = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    graphs = llm.engine_core.runner.decode_graphs
    result = {"capture_failures": graphs.num_capture_failures, "graphs": len(graphs.graphs),
              "replays": graphs.num_replays, "same_tokens": ours == expected}
    del llm
    torch.cuda.empty_cache()
    return result


def check_kv_sizing(directory: Path, device: str) -> dict:
    from engine import LLM

    if device != "cuda":
        return {}
    free_before, total = torch.cuda.mem_get_info()
    llm = LLM(model=str(directory), dtype=torch.bfloat16, device=device, max_model_len=2048)
    free_after, _ = torch.cuda.mem_get_info()
    blocks = llm.engine_core.kv_cache.num_blocks
    result = {"num_kv_blocks": blocks, "total_gib": total / 2**30, "free_before_gib": free_before / 2**30,
              "used_after_share": 1 - free_after / total, "gpu_memory_utilization": 0.9}
    del llm
    torch.cuda.empty_cache()
    return result


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_engine(directory: Path, device: str, batch: int, prompt_len: int, max_new: int,
                profile: bool = False, enforce_eager: bool = False) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=str(directory), dtype=torch.bfloat16, device=device, num_kv_blocks=4096, max_model_len=2048,
              max_num_seqs=max(batch, 1), max_num_batched_tokens=8192, seed=0, enforce_eager=enforce_eager)
    start = time.perf_counter()
    llm.engine_core.warm_up()  # on a GPU: compiles the kernels and captures the decode graphs
    warm_up_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    many = [{"prompt_token_ids": p} for p in prompts_for([prompt_len] * batch, seed=7)]
    first, alone = ([{"prompt_token_ids": p}] for p in prompts_for([prompt_len] * 2, seed=8))
    warm = [{"prompt_token_ids": p} for p in prompts_for([prompt_len] * 2, seed=9)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # both paths once
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(many, params)
    sync(device)
    batch_s = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_new for o in outs)
    # one request alone: the time to its first token (a prompt of its own), then a fresh prompt
    # of the same length to the end; the difference over the tokens after the first
    sync(device)
    start = time.perf_counter()
    llm.generate(first, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    sync(device)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(alone, params)
    sync(device)
    alone_s = time.perf_counter() - start
    graphs = llm.engine_core.runner.decode_graphs
    result = {"batch_tok_s": batch * max_new / batch_s,
              "alone_ms_per_token": 1000 * (alone_s - first_s) / (max_new - 1), "warm_up_s": warm_up_s,
              "decode_graphs": None if graphs is None else {"captured": len(graphs.graphs),
                                                            "replays": graphs.num_replays}}
    if profile:
        result["profile"] = profile_steps(llm, batch, prompt_len, device)
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_steps(llm, batch: int, prompt_len: int, device: str, steps: int = 16) -> str:
    """Decode steps of a full batch: timed plainly, then under cProfile (the host's Python, by
    function), then under torch.profiler (the device's kernels): where a step's time goes."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    core = llm.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 4, ignore_eos=True)
    for index, prompt in enumerate(prompts_for([prompt_len] * batch, seed=10)):
        core.add_request(core.make_request(f"profile-{index}", prompt, params))
    budget = core.config.scheduler.max_num_batched_tokens
    for _ in range(-(-batch * prompt_len // budget) + 1):  # past the prompts
        core.step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(device)
    plain_ms = 1000 * (time.perf_counter() - start) / steps
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        core.step()
    sync(device)
    host.disable()
    listing = io.StringIO()
    pstats.Stats(host, stream=listing).sort_stats("tottime").print_stats(20)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
        sync(device)
    step_ms = 1000 * (time.perf_counter() - start) / steps
    while core.has_unfinished_requests():
        core.step()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48)
    host_table = listing.getvalue().split("\n", 4)[-1].strip()  # from the column header on
    return (f"decode step at batch {batch}: {plain_ms:.2f} ms per step unprofiled, {step_ms:.2f} under "
            f"torch.profiler\n{table}\nthe host's Python over {steps} steps (cProfile, by own time):\n{host_table}")


def time_hf(directory: Path, device: str, batch: int, prompt_len: int, max_new: int) -> dict:
    hf = load_hf(directory, torch.bfloat16, device)
    hf.generation_config.pad_token_id = 0
    many = torch.tensor(prompts_for([prompt_len] * batch, seed=7), device=device)
    first, one = (torch.tensor([p], device=device) for p in prompts_for([prompt_len] * 2, seed=8))
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(many[:2], attention_mask=torch.ones_like(many[:2]), max_new_tokens=4, **kwargs)
        sync(device)
        start = time.perf_counter()
        hf.generate(many, attention_mask=torch.ones_like(many), max_new_tokens=max_new, min_new_tokens=max_new,
                    **kwargs)
        sync(device)
        batch_s = time.perf_counter() - start
        start = time.perf_counter()
        hf.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=1, **kwargs)
        sync(device)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        hf.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=max_new, min_new_tokens=max_new,
                    **kwargs)
        sync(device)
        alone_s = time.perf_counter() - start
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"batch_tok_s": batch * max_new / batch_s, "alone_ms_per_token": 1000 * (alone_s - first_s) / (max_new - 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tandem-gpu-engine"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreted)")
    parser.add_argument("--only", choices=["tokens", "speed"], default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="torch.profiler over decode steps of the batch")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="only this model shape")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shape and not args.smoke:
        shapes = {args.shape: SHAPES[args.shape]}
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "shapes": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    failed = False
    for seed, (name, shape) in enumerate(shapes.items()):
        directory = args.work_dir / name
        if not (directory / "model.safetensors").exists():
            write_checkpoint(directory, args.tokenizer_dir, shape, seed, device)
        entry: dict = {"shape": dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads"), shape))}
        report["shapes"][name] = entry
        try:  # one part's failure is reported, and the parts after it still run
            if args.only in (None, "tokens"):
                for dtype in (torch.float32, torch.bfloat16):
                    result, prompts, reference = check_tokens(directory, device, dtype, args.smoke)
                    entry[f"tokens_{result['dtype']}"] = result
                    if dtype == torch.float32:
                        failed |= result["identical"] != result["sequences"]
                        entry["bf16_top1"] = check_bf16_against_float32(directory, device, prompts, reference)
                if seed == 0:
                    report["kv_sizing"] = check_kv_sizing(directory, device)
                    report["sampler"] = check_sampler(device)
                    failed |= report["sampler"]["same_token"] != report["sampler"]["rows"]
                    report["engine_loop"] = check_engine_loop(directory, device, args.smoke)
                    failed |= report["engine_loop"]["same_as_alone"] != report["engine_loop"]["requests"]
                    report["capture_failure"] = check_capture_failure(directory, device)
                    failed |= report["capture_failure"].get("same_tokens") is False
            if args.only in (None, "speed"):
                batch, prompt_len, max_new = (4, 20, 8) if args.smoke else (64, 250, 128)
                ours = time_engine(directory, device, batch, prompt_len, max_new, profile=args.profile)
                eager = time_engine(directory, device, batch, prompt_len, max_new, profile=args.profile,
                                    enforce_eager=True)
                theirs = time_hf(directory, device, batch, prompt_len, max_new)
                entry["speed"] = {"workload": f"{batch} x {prompt_len} in / {max_new} out, bf16", "tandem": ours,
                                  "tandem_eager": eager, "transformers": theirs,
                                  "batch_ratio": ours["batch_tok_s"] / theirs["batch_tok_s"],
                                  "alone_ratio": theirs["alone_ms_per_token"] / ours["alone_ms_per_token"]}
        except Exception:  # noqa: BLE001 - the report names it and the exit status says so
            entry["error"] = traceback.format_exc()
            print(entry["error"], file=sys.stderr, flush=True)
            failed = True
        print(json.dumps({name: entry}, indent=1), flush=True)
    for name, entry in report["shapes"].items():
        for key in ("tandem", "tandem_eager"):
            if "profile" in entry.get("speed", {}).get(key, {}):
                print(f"\n## {name}, {key}: {entry['speed'][key]['profile']}")
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


def render(report: dict) -> str:
    lines = [f"device {report['device']}, torch {report['torch']}, triton {report['triton']}", "",
             "| model | check | result |", "|---|---|---|"]
    for name, entry in report["shapes"].items():
        if "error" in entry:
            lines.append(f"| {name} | error | {entry['error'].strip().splitlines()[-1]} |")
        for key in ("tokens_float32", "tokens_bfloat16"):
            if key in entry:
                tokens = entry[key]
                verdict = "" if key.endswith("bfloat16") else (
                    " (met)" if tokens["identical"] == tokens["sequences"] else " (MISSED)")
                lines.append(f"| {name} | {key.replace('_', ' ')} vs transformers | {tokens['identical']}/"
                             f"{tokens['sequences']} identical over {tokens['tokens_each']} tokens{verdict}; "
                             f"agreed before the first difference: {tokens['agreed_before_first_difference']} |")
        if "bf16_top1" in entry:
            top1 = entry["bf16_top1"]
            lines.append(f"| {name} | bfloat16 top token = float32's (teacher-forced, {top1['positions']} positions) "
                         f"| tandem {top1['tandem']:.1%}, transformers {top1['transformers']:.1%} |")
        if "speed" in entry:
            speed = entry["speed"]
            lines.append(f"| {name} | {speed['workload']}: output tok/s | tandem {speed['tandem']['batch_tok_s']:.0f}, "
                         f"transformers {speed['transformers']['batch_tok_s']:.0f} ({speed['batch_ratio']:.2f}x) |")
            lines.append(f"| {name} | one request: ms per output token | tandem "
                         f"{speed['tandem']['alone_ms_per_token']:.2f}, transformers "
                         f"{speed['transformers']['alone_ms_per_token']:.2f} ({speed['alone_ratio']:.2f}x) |")
            if "tandem_eager" in speed:
                eager = speed["tandem_eager"]
                lines.append(f"| {name} | tandem --enforce-eager (no decode graphs) | {eager['batch_tok_s']:.0f} "
                             f"tok/s, {eager['alone_ms_per_token']:.2f} ms per token alone |")
    if report.get("sampler"):
        sampler = report["sampler"]
        verdict = "met" if sampler["same_token"] == sampler["rows"] else "MISSED"
        lines.append(f"| sampler | on the device vs the CPU, same logits | {sampler['same_token']}/{sampler['rows']} "
                     f"same token ({verdict}); logprobs differ by at most {sampler['max_logprob_difference']:.1e} |")
    if report.get("engine_loop"):
        loop = report["engine_loop"]
        verdict = "met" if loop["same_as_alone"] == loop["requests"] else "MISSED"
        lines.append(f"| engine thread | {loop['requests']} requests added while others decode (float32, greedy and "
                     f"seeded draws) | {loop['finished']} finished, {loop['same_as_alone']} with the tokens each gets "
                     f"alone ({verdict}); {loop['decode_graph_replays']} graph replays |")
    if report.get("capture_failure"):
        capture = report["capture_failure"]
        verdict = "met" if capture["same_tokens"] and capture["capture_failures"] == 1 else "MISSED"
        lines.append(f"| decode graphs | one capture fails on the device | {capture['capture_failures']} failed, "
                     f"{capture['graphs']} keys, {capture['replays']} replays; tokens equal --enforce-eager's: "
                     f"{capture['same_tokens']} ({verdict}) |")
    if report.get("kv_sizing"):
        sizing = report["kv_sizing"]
        lines.append(f"| KV sizing | gpu_memory_utilization 0.9 | {sizing['num_kv_blocks']} blocks; "
                     f"{sizing['used_after_share']:.1%} of {sizing['total_gib']:.0f} GiB in use after |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
