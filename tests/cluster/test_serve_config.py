"""`tandem serve`'s flags, their TANDEM_* defaults and the checks ServeConfig makes once."""

from __future__ import annotations

import argparse

import pytest

from cluster.serve_config import ServeConfig, add_serve_arguments


def config_of(argv: list[str], env: dict | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env or {})
    return ServeConfig.from_namespace(parser.parse_args(argv))


def test_the_failure_flags_and_their_defaults():
    config = config_of([])
    assert (config.migration_limit, config.worker_max_restarts, config.request_timeout) == (3, -1, 600.0)
    config = config_of(["--migration-limit", "0", "--worker-max-restarts", "5"])
    assert (config.migration_limit, config.worker_max_restarts) == (0, 5)
    assert config_of([], {"TANDEM_MIGRATION_LIMIT": "1"}).migration_limit == 1
    assert config.orphan_timeout == 120.0 and config_of(["--orphan-timeout", "0"]).orphan_timeout == 0.0


def test_out_of_range_values_are_refused_with_the_flag_named():
    with pytest.raises(ValueError, match="--migration-limit must be >= 0"):
        config_of(["--migration-limit", "-1"])
    with pytest.raises(ValueError, match="--worker-max-restarts >= -1"):
        config_of(["--worker-max-restarts", "-2"])
    with pytest.raises(ValueError, match="--orphan-timeout must be >= 0"):
        config_of(["--orphan-timeout", "-1"])
    with pytest.raises(ValueError, match=r"--kv-transport \(or TANDEM_KV_TRANSPORT\) must be one of grpc, torch"):
        config_of([], {"TANDEM_KV_TRANSPORT": "carrier-pigeon"})


def test_the_prefill_lane_flag_and_which_workers_get_it():
    from cluster.placement import Mode
    from cluster.serve import ServeCluster, ServePlan
    from engine.prefill_lane import DEFAULT_PREFILL_LANE_MIN_TOKENS

    assert config_of([]).prefill_lane_min_tokens == DEFAULT_PREFILL_LANE_MIN_TOKENS
    assert config_of(["--prefill-lane-min-tokens", "off"]).prefill_lane_min_tokens is None
    assert config_of(["--prefill-lane-min-tokens", "300"]).prefill_lane_min_tokens == 300
    assert config_of([], {"TANDEM_PREFILL_LANE_MIN_TOKENS": "64"}).prefill_lane_min_tokens == 64
    with pytest.raises(SystemExit):  # argparse names the flag and exits
        config_of(["--prefill-lane-min-tokens", "-5"])

    class Info:
        model_dir = "/weights"

    for mode, lane in ((Mode.COLOCATED, 300), (Mode.DISAGG, None)):  # a disaggregated decode worker has none
        cluster = ServeCluster.__new__(ServeCluster)
        cluster.config = config_of(["--prefill-lane-min-tokens", "300"])
        cluster.info, cluster.chat_template = Info(), None
        cluster.plan = ServePlan(mode, 2, {}, {}, 1024, "", "")
        assert cluster.engine_args().prefill_lane_min_tokens == lane


def test_the_prefill_lane_wait_bound():
    from engine.prefill_lane import DEFAULT_PREFILL_LANE_MAX_WAIT_MS

    assert config_of([]).prefill_lane_max_wait_ms == DEFAULT_PREFILL_LANE_MAX_WAIT_MS
    assert config_of(["--prefill-lane-max-wait-ms", "1500"]).prefill_lane_max_wait_ms == 1500.0
    assert config_of(["--prefill-lane-max-wait-ms", "0"]).prefill_lane_max_wait_ms == 0.0
    assert config_of(["--prefill-lane-max-wait-ms", "off"]).prefill_lane_max_wait_ms is None
    with pytest.raises(SystemExit):
        config_of(["--prefill-lane-max-wait-ms", "-1"])


def test_the_prefill_lane_policy_flag_reaches_the_engine():
    from cluster.placement import Mode
    from cluster.serve import ServeCluster, ServePlan
    from engine.prefill_lane import DEFAULT_PREFILL_LANE_POLICY

    assert config_of([]).prefill_lane_policy == DEFAULT_PREFILL_LANE_POLICY
    assert config_of(["--prefill-lane-policy", "overflow"]).prefill_lane_policy == "overflow"
    assert config_of([], {"TANDEM_PREFILL_LANE_POLICY": "overflow"}).prefill_lane_policy == "overflow"
    with pytest.raises(SystemExit):
        config_of(["--prefill-lane-policy", "sometimes"])

    class Info:
        model_dir = "/weights"

    cluster = ServeCluster.__new__(ServeCluster)
    cluster.config = config_of(["--prefill-lane-policy", "overflow"])
    cluster.info, cluster.chat_template = Info(), None
    cluster.plan = ServePlan(Mode.COLOCATED, 2, {}, {}, 1024, "", "")
    assert cluster.engine_args().prefill_lane_policy == "overflow"
    cluster.config = config_of(["--prefill-lane-policy", "pace", "--prefill-lane-pace-ms", "65"])
    args = cluster.engine_args()
    assert (args.prefill_lane_policy, args.prefill_lane_pace_ms) == ("pace", 65.0)
    assert config_of([], {"TANDEM_PREFILL_LANE_PACE_MS": "70"}).prefill_lane_pace_ms == 70.0
    for bad in ("0", "-5", "nan", "fast"):
        with pytest.raises(SystemExit):
            config_of(["--prefill-lane-pace-ms", bad])
    cluster.config = config_of(["--prefill-lane-help-ms", "65"])
    assert cluster.engine_args().prefill_lane_help_ms == 65.0
    assert config_of([]).prefill_lane_help_ms == 80.0
    assert config_of(["--prefill-lane-help-ms", "off"]).prefill_lane_help_ms is None
    for bad in ("0", "-5", "nan", "fast"):
        with pytest.raises(SystemExit):
            config_of(["--prefill-lane-help-ms", bad])
    cluster.config = config_of(["--prefill-lane-ttft-ratio", "1.5"])
    assert cluster.engine_args().prefill_lane_ttft_ratio == 1.5
    assert config_of([]).prefill_lane_ttft_ratio is None
    assert config_of(["--prefill-lane-ttft-ratio", "off"]).prefill_lane_ttft_ratio is None
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            config_of(["--prefill-lane-ttft-ratio", bad])


def test_enforce_eager_reaches_the_engine():
    """vLLM's flag: on a GPU, decode steps run eagerly instead of replaying CUDA graphs."""
    from cluster.placement import Mode
    from cluster.serve import ServeCluster, ServePlan

    assert config_of([]).enforce_eager is False
    assert config_of(["--enforce-eager"]).enforce_eager is True

    class Info:
        model_dir = "/weights"

    cluster = ServeCluster.__new__(ServeCluster)
    cluster.config = config_of(["--enforce-eager"])
    cluster.info, cluster.chat_template = Info(), None
    cluster.plan = ServePlan(Mode.DISAGG, 2, {}, {}, 1024, "", "")
    assert cluster.engine_args().enforce_eager is True
