"""vLLM's offline engine timed as bench/context_bench.py times tandem's: run by the peers
venv's Python (`make peers`), never imported by tandem. argv[1] is a JSON file with the
model, dtype and cases (each with its prompts as token ids); one JSON line per case comes out
on stdout: the milliseconds of each decode step once every sequence has its first token."""

import json
import statistics
import sys
import time


# The timing loop mirrors bench/context_bench.py's on purpose: this file runs where tandem is
# not installed, so it cannot import it, and both sides must measure alike.
def decode_step_ms(engine, sampling_params_type, prompts: list[list[int]], new_tokens: int, tag: str) -> float:
    params = sampling_params_type(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    steps = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - began
        decoding = len(started) == len(prompts)  # every sequence had its first token before this step
        started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
        if decoding and outputs:
            steps.append(elapsed)
    return statistics.median(steps) * 1000


def main() -> None:
    with open(sys.argv[1]) as handle:
        config = json.load(handle)
    from vllm import LLM, SamplingParams

    llm = LLM(model=config["model"], dtype=config["dtype"], max_model_len=config["max_model_len"],
              max_num_seqs=config["max_batch"], max_num_batched_tokens=config["max_num_batched_tokens"],
              enable_prefix_caching=False, seed=0)
    engine = llm.llm_engine
    decode_step_ms(engine, SamplingParams, config["warm_up"], 4, "warm-up")
    for number, case in enumerate(config["cases"]):  # the median step hides a first-use compile
        ms = decode_step_ms(engine, SamplingParams, case["prompts"], config["new_tokens"], f"case-{number}")
        print(json.dumps({"context": case["context"], "batch": case["batch"], "step_ms": ms}), flush=True)


if __name__ == "__main__":
    main()
