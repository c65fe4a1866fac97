"""The service YAML: typed configs out, and every bad value named by file and key path."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from bucketserve.bucket_manager.config import BatchingConfig, RequestBucketConfig
from bucketserve.controller.config import ControllerConfig
from bucketserve.deploy.cli import run_check
from bucketserve.deploy.serve_config import ServeConfig, ServeConfigError
from bucketserve.deploy.serve_settings import ModelSettings
from bucketserve.deploy.service_runner import flag_overrides
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.runtime.worker.device import DTYPES
from tests.gguf_reads import one_parse_per_gguf

DEPLOY = Path(__file__).resolve().parents[2] / "bucketserve" / "deploy"
EXAMPLES = sorted(p for p in DEPLOY.glob("serve*.yaml"))


def write(tmp_path: Path, data: Any, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_shipped_example_passes_config_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert [p.name for p in EXAMPLES] == ["serve-gaudi.yaml", "serve-local.yaml", "serve.yaml"]
    with one_parse_per_gguf():  # the embedded model's metadata, read once for the three
        for path in EXAMPLES:
            assert run_check(argparse.Namespace(file=path)) == 0, capsys.readouterr().err
            assert f"{path}: valid" in capsys.readouterr().out


def test_the_yaml_lands_in_the_typed_configs(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = {
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "max_model_len": 256},
        "kv_cache": {"block_size": 8, "memory_fraction": 0.5, "num_blocks": 300},
        "controller": {
            "ray_address": "auto",
            "topology": "disaggregated",
            "prefill": {"num_workers": 2, "accelerator": "hpu", "resources": {"p": 1},
                        "kv_blocks": 40},
            "decode": {"num_workers": 3, "accelerator": "hpu", "max_num_seqs": 32,
                       "pipeline_depth": 2, "pace": 0.8},
        },
        "buckets": {"strategy": "linear", "theta": 0.7, "max_buckets": 8,
                    "prompt": {"bs": [1, 1, 4], "query": [8, 8, 64]},
                    "batching": {"safety_fraction": 0.8}},
        "tenants": [{"name": "a", "api_keys": ["k"], "class": "offline", "policy": "ljf"}],
        "gateway": {"grpc_port": 6000, "http_port": None},
        "cluster": {"resources": {"HPU": 5}},
    }
    config = ServeConfig.load(write(tmp_path, data))
    controller = config.controller_config()
    runner = controller.runner
    assert (runner.model, runner.dtype, runner.max_model_len) == (str(tiny_model_dir),
                                                                 "float32", 256)
    assert (runner.block_size, runner.kv_memory_fraction, runner.num_kv_blocks) == (8, 0.5, 300)
    prefill, decode = controller.prefill, controller.decode
    assert (prefill.num_workers, decode.num_workers, prefill.kv_blocks) == (2, 3, 40)
    assert prefill.resources == {"p": 1}
    assert decode.accelerator == "hpu"
    assert (decode.max_num_seqs, decode.pipeline_depth) == (32, 2)
    assert (controller.topology, decode.pace) == ("disaggregated", 0.8)
    assert (controller.mode, controller.ray_address) == ("ray", "auto")
    buckets = controller.buckets
    assert (buckets.request_buckets.theta, buckets.request_buckets.max_len) == (0.7, 256)
    assert buckets.request_buckets.max_buckets == 8
    assert buckets.batching.safety_fraction == 0.8
    shapes = buckets.shape_buckets
    assert (shapes.strategy, shapes.block_size, shapes.max_model_len) == ("linear", 8, 256)
    assert shapes.prompt.query.as_list(with_limit=False) == [8, 8, 64]
    assert shapes.decode.bs.max == 32  # not given: derived from max_num_seqs
    (tenant,) = buckets.tenants
    assert (tenant.name, tenant.tenant_class, tenant.policy) == ("a", "offline", "ljf")
    assert config.tenants.auth_required and config.tenants.authenticate("k").name == "a"
    assert (config.gateway.grpc_port, config.gateway.http_port) == (6000, None)
    assert config.actor_resources("prefill") == {"CPU": 1.0, "p": 1, "HPU": 1}


def test_flags_override_the_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write(tmp_path, {"controller": {"ray_address": "10.0.0.1:6379"},
                            "gateway": {"grpc_port": 6000}})
    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = argparse.Namespace(config=path, grpc_port=7000, http_port=None, host="0.0.0.0",
                              model=str(tiny_model_dir), chat_template=str(template),
                              ray_address=None, local=True)
    config = ServeConfig.load(path, flag_overrides(args))
    assert (config.gateway.grpc_port, config.gateway.host) == (7000, "0.0.0.0")
    assert config.controller.runner.model == str(tiny_model_dir)
    # the text travels to the workers, which may not see the file
    assert config.controller.runner.chat_template == template.read_text()
    assert (config.controller.mode, config.controller.ray_address) == ("local", None)
    args.local, args.grpc_port = False, -5
    with pytest.raises(ServeConfigError, match=r"^--grpc-port: gateway\.grpc_port: must be"):
        ServeConfig.load(path, flag_overrides(args))


def test_the_settings_defaults_are_the_configs_defaults() -> None:
    config = ServeConfig.from_dict({})
    assert config.controller == ControllerConfig()
    assert config.gateway == GatewayConfig()
    assert config.request_buckets == RequestBucketConfig()
    assert config.batching == BatchingConfig()
    dtypes = ModelSettings.model_fields["dtype"].annotation.__args__
    assert set(dtypes) == {"auto", *DTYPES}


def test_an_empty_section_is_left_out_and_tenants_may_be_a_mapping_by_name() -> None:
    config = ServeConfig.from_dict({"controller": None, "tenants": {"a": {"api_keys": "k"}}})
    assert config.controller == ControllerConfig()
    assert config.tenants.authenticate("k").name == "a"


def test_no_file_is_the_embedded_default() -> None:
    config = ServeConfig.load(None)
    assert config.controller.runner.model is None
    assert (config.controller.prefill.num_workers, config.controller.decode.num_workers) == (1, 1)
    assert not config.tenants.auth_required


def test_decode_engines_schedule_by_priority_unless_the_yaml_says_fcfs() -> None:
    assert ServeConfig.from_dict({}).controller.decode.scheduling_policy == "priority"
    fcfs = ServeConfig.from_dict({"controller": {"decode": {"scheduling_policy": "fcfs"}}})
    assert fcfs.controller.decode.scheduling_policy == "fcfs"


def test_late_prompts_yield_for_8_s_unless_the_yaml_says_otherwise() -> None:
    assert ServeConfig.from_dict({}).controller.decode.late_yield_s == 8.0
    for value in (None, 3.5):
        config = ServeConfig.from_dict({"controller": {"decode": {"late_yield_s": value}}})
        assert config.controller.decode.late_yield_s == value


def test_prefix_caching_is_on_in_every_worker_unless_the_yaml_turns_it_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    from bucketserve.bucket_manager.config import BucketManagerConfig
    from bucketserve.controller.worker_pool import WorkerPool

    model = {"model": {"path": str(tiny_model_dir)}}  # the check reads no GGUF's metadata
    for given, want in ((None, True), (True, True), (False, False)):
        kv = {} if given is None else {"kv_cache": {"enable_prefix_caching": given}}
        path = write(tmp_path, {**model, **kv})
        assert run_check(argparse.Namespace(file=path)) == 0, capsys.readouterr().err
        assert f"prefix caching {'on' if want else 'off'}" in capsys.readouterr().out
        controller = ServeConfig.load(path).controller
        assert controller.runner.enable_prefix_caching is want
        pool = WorkerPool(controller, BucketManagerConfig())
        assert pool.prefill_config(0).runner.enable_prefix_caching is want
        decode = pool.decode_config(0)
        assert decode.engine.runner.enable_prefix_caching is want
    path = write(tmp_path, {"kv_cache": {"enable_prefix_caching": "yes"}})
    assert run_check(argparse.Namespace(file=path)) == 1
    err = capsys.readouterr().err
    assert f"{path}: kv_cache.enable_prefix_caching: must be true or false" in err


HPU_CLUSTER = {"cluster": {"resources": {"HPU": 4}}}
BROKEN = [
    ({"controller": {"prefill": {"num_workers": 0}}},
     "controller.prefill.num_workers", "must be an integer >= 1, got 0"),
    ({"controller": {"prefill": {"num_workers": "two"}}},
     "controller.prefill.num_workers", "must be an integer >= 1, got a string 'two'"),
    ({"controller": {"prefill": {"nm_workers": 1}}},
     "controller.prefill.nm_workers", "did you mean 'num_workers'"),
    ({"modle": {"path": None}}, "modle", "did you mean 'model'"),
    ({"controller": "ray"}, "controller", "must be a mapping, got a string"),
    ({"controller": {"mode": "k8s"}}, "controller.mode", "one of 'ray', 'local', got 'k8s'"),
    ({"controller": {"mode": "local", "ray_address": "auto"}},
     "controller.ray_address", "mode 'local' runs every worker in this process"),
    ({"controller": {"decode": {"enable_chunked_prefill": "yes"}}},
     "controller.decode.enable_chunked_prefill", "must be true or false"),
    ({"controller": {"decode": {"scheduling_policy": "sjf"}}},
     "controller.decode.scheduling_policy", "must be one of 'fcfs', 'priority', got 'sjf'"),
    ({"controller": {"decode": {"late_yield_s": 0}}},
     "controller.decode.late_yield_s", "must be a number > 0 or null, got 0"),
    ({"controller": {"decode": {"slo_hold_fraction": 0.5}}},
     "controller.decode.slo_hold_fraction", "unknown key 'slo_hold_fraction'"),
    ({"controller": {"decode": {"pace": 0.8}}},
     "controller.decode.pace", "the colocated topology has none"),
    ({"controller": {"mode": "local", "transport": "ray"}},
     "controller.transport", "mode 'local' keeps every worker in this process"),
    ({"controller": {"prefill": {"stage_packing": "SPREAD"}}},
     "controller.prefill.stage_packing", "one of 'PACK', 'STRICT_PACK', got 'SPREAD'"),
    ({"controller": {"decode": {"pipeline_parallel_size": 0}}},
     "controller.decode.pipeline_parallel_size", "must be an integer >= 1, got 0"),
    ({"controller": {"pad_to_shape_buckets": "yes"}},
     "controller.pad_to_shape_buckets", "must be 'auto' or true or false, got a string 'yes'"),
    ({"controller": {"prefill": {"resources": {"HPU": "one"}}}},
     "controller.prefill.resources", "a mapping of names to numbers"),
    ({"controller": {"topology": "disaggregated",
                     "decode": {"num_workers": 3, "accelerator": "hpu"},
                     "prefill": {"num_workers": 2, "accelerator": "hpu"}}, **HPU_CLUSTER},
     "controller.decode.num_workers", "need 5 HPU but cluster.resources.HPU is 4"),
    ({"controller": {"decode": {"num_workers": 2, "accelerator": "hpu",
                                "tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
      **HPU_CLUSTER},
     "controller.decode.num_workers", "need 8 HPU but cluster.resources.HPU is 4"),
    ({"controller": {"topology": "disaggregated", "prefill": {"num_workers": 5}}, **HPU_CLUSTER},
     "controller.prefill.num_workers", "at most 4 prefill workers"),
    ({"model": {"device": "hpu"}, "controller": {"prefill": {"accelerator": "gpu"}}},
     "controller.prefill.accelerator", "must be 'auto' or 'hpu'"),
    ({"model": {"device": "tpu"}}, "model.device", "'cpu', 'cuda'"),
    ({"model": {"dtype": "int4"}}, "model.dtype", "'bfloat16'"),
    ({"model": {"max_model_len": 0}}, "model.max_model_len", ">= 1"),
    ({"model": {"chat_template": "/nonexistent/chat.jinja"}}, "model.chat_template",
     "/nonexistent/chat.jinja is not a file"),
    ({"kv_cache": {"memory_fraction": 1.5}}, "kv_cache.memory_fraction", "in (0, 1], got 1.5"),
    ({"kv_cache": {"memory_fraction": 0}}, "kv_cache.memory_fraction", "in (0, 1], got 0"),
    ({"kv_cache": {"block_size": -16}}, "kv_cache.block_size", "an integer >= 1, got -16"),
    ({"kv_cache": {"enable_prefix_caching": 1}}, "kv_cache.enable_prefix_caching",
     "must be true or false"),
    ({"kv_cache": {"prefix_caching": False}}, "kv_cache.prefix_caching",
     "did you mean 'enable_prefix_caching'"),
    ({"gateway": {"grpc_port": -1}}, "gateway.grpc_port", "an integer in [0, 65535], got -1"),
    ({"gateway": {"http_port": 70000}}, "gateway.http_port", "in [0, 65535] or null, got 70000"),
    ({"gateway": {"http_port": 9000, "grpc_port": 9000}}, "gateway.http_port", "must differ"),
    ({"gateway": {"tls_cert_file": "/nonexistent/cert.pem"}}, "gateway.tls_cert_file",
     "go together"),
    ({"buckets": {"strategy": "logarithmic"}}, "buckets.strategy", "'exponential', 'linear'"),
    ({"buckets": {"strategy": "file"}}, "buckets.file", "required by the 'file' strategy"),
    ({"buckets": {"theta": 0}}, "buckets.theta", "(0, 1]"),
    ({"buckets": {"theta": 1.5}}, "buckets.theta", "in (0, 1], got 1.5"),
    ({"buckets": {"lookup": "linear"}}, "buckets.lookup", "unknown key 'lookup'"),
    ({"buckets": {"shape_edge_snap": 0}}, "buckets.shape_edge_snap", "unknown key"),
    ({"buckets": {"max_len": 1}}, "buckets.max_len", ">= 2"),
    ({"buckets": {"max_len": 512}, "model": {"max_model_len": 256}},
     "buckets.max_len", "differs from model.max_model_len 256"),
    ({"buckets": {"prompt": {"bs": [1, 2]}}}, "buckets.prompt.bs", "[min, step, max]"),
    ({"buckets": {"decode": {"blocks": [1, 1, 64]}}}, "buckets.decode.blocks.limit",
     "required by the exponential strategy"),
    ({"buckets": {"prompt": {"query": [10, 1, 5, 3]}}}, "buckets.prompt.query.max",
     "must be >= min (10), got 5"),
    ({"buckets": {"batching": {"safety_fraction": 2}}}, "buckets.batching.safety_fraction",
     "in (0, 1], got 2"),
    ({"buckets": {"batching": {"fit_batch_buckets": False}}},
     "buckets.batching.fit_batch_buckets", "unknown key"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "colour": "red"}]},
     "tenants[0].colour", "unknown key 'colour'"),
    ({"tenants": [{"name": "a", "api_keys": ["k"], "policy": "sjf"}]},
     "tenants", "online tenants are served by earliest arrival"),
    ({"tenants": [{"name": "a"}, {"name": "b", "api_keys": ["k"]}]},
     "tenants", "tenant 'a' has no api_keys"),
    ({"cluster": {"resources": {"HPU": -1}}}, "cluster.resources.HPU", ">= 0"),
    ({"controller": {"topology": "collocated"}}, "controller.topology", "'colocated'"),
    ({"controller": {"shape": "colocated", "topology": "colocated"}}, "controller.shape",
     "old name of controller.topology: give only topology"),
    ({"controller": {"shape": "collocated"}}, "controller.topology", "'colocated'"),
    ({"controller": {"worker_timeout_s": 0}}, "controller.worker_timeout_s",
     "must be a number > 0, got 0"),
    ({"controller": {"decode": {"cpus": [1, 1]}}}, "controller.decode.cpus", "distinct core ids"),
    ({"controller": {"prefill": {"cpus": "0-1"}}}, "controller.prefill.cpus",
     "must be a list of integers >= 0 or null, got a string '0-1'"),
]


def test_cores_partitioned_between_the_roles_pin_each_actor_and_size_its_pool(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, {"controller": {"topology": "disaggregated",
                                           "prefill": {"cpus": [0]}, "decode": {"cpus": [1]}}})
    controller = ServeConfig.load(path).controller
    assert (controller.cpus("prefill"), controller.cpus("decode")) == ([0], [1])
    assert (controller.torch_threads("prefill"), controller.torch_threads("decode")) == (1, 1)
    local = controller.model_copy(update={"mode": "local"})
    assert local.cpus("prefill") is None  # one process: nothing to partition


def test_pin_cpus_keeps_the_process_on_those_cores() -> None:
    code = (
        "import os; from bucketserve.kv_worker.worker_env import pin_cpus; pin_cpus([0]); "
        "print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0]"


def test_the_old_key_shape_is_read_as_topology_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, {"controller": {"shape": "disaggregated"}})
    assert ServeConfig.load(path).controller.topology == "disaggregated"
    assert "controller.shape is deprecated: write controller.topology" in caplog.text


@pytest.mark.parametrize(("data", "key", "allowed"), BROKEN,
                         ids=[f"{i}-{case[1]}" for i, case in enumerate(BROKEN)])
def test_a_broken_config_names_the_file_and_the_key(
    tmp_path: Path, data: dict[str, Any], key: str, allowed: str
) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ServeConfigError) as caught:
        ServeConfig.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {key}"), message
    assert allowed in message
    assert caught.value.path.startswith(key.split("[")[0])


def test_lengths_beyond_the_model_are_rejected_when_the_model_is_here(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = {"path": str(tiny_model_dir)}  # max_position_embeddings 512
    for data, key in [
        ({"model": {**model, "max_model_len": 1024}}, "model.max_model_len"),
        ({"model": model, "buckets": {"max_len": 600}}, "buckets.max_len"),
    ]:
        path = write(tmp_path, data)
        config = ServeConfig.load(path)  # static checks pass: the length needs the model
        with pytest.raises(ServeConfigError, match=rf"^{path}: {key}: .* allowed 2\.\.512"):
            config.controller_config()
    missing = write(tmp_path, {"model": {"path": str(tmp_path / "nope")}})
    with pytest.raises(ServeConfigError, match=r"model\.path: model path .* does not exist"):
        ServeConfig.load(missing).controller_config()


def test_config_check_command_exit_codes(tmp_path: Path, tiny_model_dir: Path) -> None:
    good = write(tmp_path, {"model": {"path": str(tiny_model_dir)},
                            "controller": {"decode": {"num_workers": 2}}}, "good.yaml")
    bad = write(tmp_path, {"model": {"path": str(tiny_model_dir), "max_model_len": 4096}},
                "bad.yaml")
    run = [sys.executable, "-m", "bucketserve.cli", "config", "check"]
    ok = subprocess.run([*run, str(good)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "decode      2 worker(s)" in ok.stdout and "max_model_len 512" in ok.stdout
    failed = subprocess.run([*run, str(bad)], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and failed.stdout == ""
    assert f"{bad}: model.max_model_len: 4096 is beyond the model's length" in failed.stderr
