"""`tandem bench compare --traffic-mix` (bench/traffic_compare.py): what each contender is
started with and sent, the table, and a real run against `tandem serve` on the tiny model."""

from __future__ import annotations

import pytest

from bench.datasets import RandomSpec, make_dataset
from bench.serve_bench import LoadConfig, schedule
from bench.traffic_compare import run_traffic, traffic_contenders, traffic_table
from bench.traffic_mix import assign, parse_mix


def test_vllm_gets_priority_scheduling_and_only_priorities_tandem_gets_its_classes(tmp_path):
    classes = tmp_path / "classes.yaml"
    classes.write_text("interactive: {priority: 0}\nbatch: {priority: 10}\n")
    tandem, vllm = traffic_contenders(["colocated", "vllm"], "m", "/hf", "float32", str(classes), "--max-num-seqs 8",
                                      {"interactive": 0, "batch": 10}, "/peers/python")
    command = tandem.contender.command
    assert command[command.index("--traffic-classes") + 1] == str(classes)
    assert command[command.index("--scheduling-policy") + 1] == "priority"
    assert command[command.index("--max-num-seqs") + 1] == "8" and tandem.class_fields == {}
    assert vllm.contender.command[-2:] == ["--scheduling-policy", "priority"]
    assert vllm.class_fields == {"interactive": {"priority": 0}, "batch": {"priority": 10}}
    with pytest.raises(ValueError, match="--traffic-classes"):
        traffic_contenders(["disagg"], "m", "/hf", "float32", None, "", {}, None)
    with pytest.raises(ValueError, match="--vllm-python"):
        traffic_contenders(["vllm"], "m", "/hf", "float32", None, "", {}, None)


def _summary(completed, ttft_p90, tpot_p90):
    stats = lambda p90: {"p50": p90 / 2, "p90": p90, "p99": p90}  # noqa: E731
    return {"completed": completed, "num_requests": completed, "refused_429": 0, "ttft_ms": stats(ttft_p90),
            "tpot_ms": stats(tpot_p90), "itl_ms": stats(tpot_p90)}


def test_the_table_compares_each_class_with_its_baseline():
    runs = {"tandem": {"baseline": {"classes": {"interactive": _summary(3, 200, 50)}},
                       "mixed": {"classes": {"interactive": _summary(3, 300, 60), "batch": _summary(7, 900, 80)}}}}
    text = traffic_table(runs)
    assert "| tandem | mixed | interactive | 3/3 | 0 | 150 / 300 | 60 | 60 | 1.50x, 1.20x |" in text
    assert "| tandem | mixed | batch | 7/7 | 0 | 450 / 900 | 80 | 80 | - |" in text


def test_a_real_run_sends_each_class_and_reports_it(tiny_llama_dir, tmp_path):
    classes = tmp_path / "classes.yaml"
    classes.write_text("interactive: {priority: 0}\nbatch: {priority: 10}\n")
    (contender,) = traffic_contenders(["colocated"], str(tiny_llama_dir), str(tiny_llama_dir), "float32",
                                      str(classes), "--max-num-seqs 2 --max-model-len 256", {}, None)
    mix = parse_mix("interactive:0.5,batch:0.5")
    requests = assign(make_dataset("random", 8, 3, RandomSpec(12, 4)), mix, 3)
    offsets = schedule(len(requests), LoadConfig("", "", request_rate=20.0, seed=3))
    drawn = {name: sum(r.traffic_class == name for r in requests) for name in mix}
    runs = run_traffic(contender, requests, offsets, "interactive", None, None, [], 3, say=lambda line: None)
    assert set(runs["baseline"]["classes"]) == {"interactive"}
    assert runs["baseline"]["classes"]["interactive"]["completed"] == drawn["interactive"]
    assert {name: s["completed"] for name, s in runs["mixed"]["classes"].items()} == drawn
