"""vLLM's offline engine timed as bench/context_bench.py times tandem's: run by the peers
venv's Python (`make peers`), never imported by tandem. argv[1] is a JSON file with the
model, dtype and cases (each with its prompts as token ids); one JSON line per case comes out
on stdout: the milliseconds of each decode step once every sequence has its first token. With
``"mode": "tpot"`` (bench/served_bench.py) it answers on demand instead: after the warm-up it
prints ``{"ready": true}``, then reads one JSON line per case on stdin (``prompts``,
``new_tokens``) and prints each request's milliseconds per output token after its first, all
the case's prompts sent at once; it ends at the end of stdin. With ``"mode": "generate"``
(bench/engine_bench.py) it times ``LLM.generate`` per batch as engine_bench times transformers:
decode tok/s = batch x (new_tokens - 1) / (time of new_tokens - time of 1 token); and, where
the config has a ``prefill_prompt``, that prompt read whole for one token out (best of
``prefill_repeats`` after a warm-up at its length): prefill tok/s."""

import json
import sys
import time

from step_timing import median_decode_step_ms  # this file's directory is on sys.path: it runs as a script


def decode_step_ms(engine, sampling_params_type, prompts: list[list[int]], new_tokens: int, tag: str) -> float:
    params = sampling_params_type(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": prompt}, params)
    def got_tokens(outputs) -> list[str]:
        return [o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids]

    return median_decode_step_ms(engine.step, engine.has_unfinished_requests, len(prompts), got_tokens)


def request_tpots(engine, sampling_params_type, prompts: list[list[int]], new_tokens: int, tag: str) -> list[float]:
    params = sampling_params_type(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": prompt}, params)
    first, last, count = {}, {}, {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            made = len(output.outputs[0].token_ids) if output.outputs else 0  # cumulative
            if made > count.get(output.request_id, 0):
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
                count[output.request_id] = made
    return [(last[r] - first[r]) / (count[r] - 1) * 1000 for r in first if count[r] > 1]


def generate_tok_s(llm, sampling_params_type, prompts: list[list[int]], new_tokens: int) -> float:
    def timed(max_tokens: int) -> float:
        params = sampling_params_type(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(2)  # warm-up: vLLM compiles on its first batch of a size
    prefill = timed(1)
    total = timed(new_tokens)
    return len(prompts) * (new_tokens - 1) / max(total - prefill, 1e-9)


def prefill_tok_s(llm, sampling_params_type, prompt: list[int], repeats: int) -> float:
    params = sampling_params_type(max_tokens=1, ignore_eos=True, temperature=0.0)
    batch = [{"prompt_token_ids": prompt}]
    llm.generate(batch, params, use_tqdm=False)  # warm-up at this length (prefix caching is off)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return len(prompt) / best


def main() -> None:
    with open(sys.argv[1]) as handle:
        config = json.load(handle)
    from vllm import LLM, SamplingParams

    llm = LLM(model=config["model"], dtype=config["dtype"], max_model_len=config["max_model_len"],
              max_num_seqs=config["max_batch"], max_num_batched_tokens=config["max_num_batched_tokens"],
              enable_prefix_caching=False, seed=0)
    engine = llm.llm_engine
    if config.get("mode") == "generate":
        if config.get("prefill_prompt"):
            print(json.dumps({"prefill_tok_s": prefill_tok_s(llm, SamplingParams, config["prefill_prompt"],
                                                             config.get("prefill_repeats", 3))}), flush=True)
        for case in config["cases"]:
            print(json.dumps({"batch": case["batch"], "decode_tok_s": generate_tok_s(
                llm, SamplingParams, case["prompts"], config["new_tokens"])}), flush=True)
        return
    if config.get("mode") == "tpot":
        request_tpots(engine, SamplingParams, config["warm_up"], 8, "warm-up")
        print(json.dumps({"ready": True}), flush=True)
        for number, line in enumerate(sys.stdin):
            case = json.loads(line)
            tpots = request_tpots(engine, SamplingParams, case["prompts"], case["new_tokens"], f"case-{number}")
            print(json.dumps({"tpot_ms": tpots}), flush=True)
        return
    decode_step_ms(engine, SamplingParams, config["warm_up"], 4, "warm-up")
    for number, case in enumerate(config["cases"]):  # the median step hides a first-use compile
        ms = decode_step_ms(engine, SamplingParams, case["prompts"], config["new_tokens"], f"case-{number}")
        print(json.dumps({"context": case["context"], "batch": case["batch"], "step_ms": ms}), flush=True)


if __name__ == "__main__":
    main()
