"""The launcher's command line: SGLang's flags and the --sparse-* flags together, and bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sparse_sglang import launch_server
    from sparse_sglang.integration.server_args import SparseServerArgs, build_parser, prepare_server_args
from sparse_sglang.config import SparseConfig, SparseConfigError
from sparse_sglang.sparse_flags import CLIError
from sparse_sglang.testing.models import write_llama3_8b_dummy

REPO = Path(__file__).resolve().parents[1]

# ServerArgs resolves its defaults against an accelerator; this machine has none.
CPU = ["--device", "cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_llama3_8b_dummy(tmp_path_factory.mktemp("llama3-8b"))


def test_sglang_and_sparse_flags_together(model_dir):
    args = prepare_server_args(
        [
            "--model-path",
            model_dir,
            *CPU,
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--max-total-tokens",
            "163840",
            "--chunked-prefill-size",
            "8192",
            "--port",
            "31234",
            "--sparse-token-budget",
            "1024",
            "--sparse-selector",
            "arkvale",
            "--sparse-page-size",
            "16",
            "--sparse-host-cache-gb",
            "1.5",
            "--sparse-enabled",
            "on",
        ]
    )
    assert isinstance(args, SparseServerArgs)
    assert (args.max_total_tokens, args.chunked_prefill_size, args.port) == (163840, 8192, 31234)
    assert args.load_format == "dummy" and args.skip_tokenizer_init
    assert args.sparse == SparseConfig(token_budget=1024, selector="arkvale", page_size=16, host_cache_gb=1.5)
    assert args.attention_backend == "sparse"


def test_sparse_defaults_when_no_sparse_flag(model_dir):
    args = prepare_server_args(["--model-path", model_dir, *CPU])
    defaults = SparseConfig()
    assert args.sparse.token_budget == defaults.token_budget and args.sparse.selector == defaults.selector
    assert args.attention_backend == "sparse"


def test_sparse_sets_the_sglang_modes_it_needs(model_dir):
    args = prepare_server_args(["--model-path", model_dir, *CPU])
    assert args.page_size == args.sparse.page_size
    assert not args.disable_overlap_schedule  # SGLang's overlap scheduler, as vanilla runs
    assert args.disable_prefill_cuda_graph and not args.disable_decode_cuda_graph  # graph decode by default
    segmented = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-segmented-prefill", "true"])
    assert segmented.disable_overlap_schedule  # its loop is SGLang's normal one
    eager = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-decode-cuda-graph", "false"])
    assert eager.disable_prefill_cuda_graph and eager.disable_decode_cuda_graph


def test_prefill_graphs_are_breakable_ones_on_request(model_dir):
    graphs = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-prefill-cuda-graph", "true"])
    assert not graphs.disable_prefill_cuda_graph and graphs.sparse.prefill_cuda_graph
    given = prepare_server_args(["--model-path", model_dir, *CPU, "--cuda-graph-backend-prefill", "breakable"])
    assert not given.disable_prefill_cuda_graph  # SGLang's own flag, with the one backend that keeps attention eager
    with pytest.raises(CLIError, match=r"^--cuda-graph-backend-prefill full: .*only breakable prefill graphs"):
        prepare_server_args(["--model-path", model_dir, *CPU, "--cuda-graph-backend-prefill", "full"])
    with pytest.raises(CLIError, match=r"^--cuda-graph-backend-prefill breakable: --sparse-segmented-prefill runs"):
        prepare_server_args(["--model-path", model_dir, *CPU, "--cuda-graph-backend-prefill", "breakable",
                             "--sparse-segmented-prefill", "true"])  # fmt: skip
    with pytest.raises(SparseConfigError, match=r"^prefill_cuda_graph: segmented_prefill runs a prefill"):
        SparseConfig(prefill_cuda_graph=True, segmented_prefill=True, host_cache_gb=1)


def test_segmented_prefill_bounds_the_in_layer_chunk_unless_given(model_dir, monkeypatch):
    import sglang.srt.server_args as sglang_server_args

    from sparse_sglang.config import SEGMENTED_CHUNK_TOKENS

    # An 80 GB GPU, where SGLang's own default chunk is 8192 tokens.
    monkeypatch.setattr(sglang_server_args, "get_device_memory_capacity", lambda device=None: 80 * 1024)
    plain = prepare_server_args(["--model-path", model_dir, *CPU])
    segmented = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-segmented-prefill", "true"])
    assert plain.chunked_prefill_size == 8192 and segmented.chunked_prefill_size == SEGMENTED_CHUNK_TOKENS == 4096
    given = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-segmented-prefill", "true",
                                 "--chunked-prefill-size", "8192"])  # fmt: skip
    assert given.chunked_prefill_size == 8192


def test_a_time_between_tokens_paces_interleaved_prefill_within_sglangs_chunk(model_dir):
    args = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-interleave-prefill", "true",
                                "--sparse-tbt-target-ms", "80", "--chunked-prefill-size", "2048"])  # fmt: skip
    assert args.sparse.tbt_target_ms == 80 and args.chunked_prefill_size == 2048  # the largest chunk paced


def test_a_budget_too_wide_for_graph_decode_decodes_eagerly_and_says_so(model_dir, capfd):
    args = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-token-budget", "32768"])
    assert args.disable_decode_cuda_graph
    assert "a budget of 32768 tokens is too wide for the fused decode kernels" in capfd.readouterr().err


def test_sparse_off_leaves_attention_backend_to_sglang(model_dir):
    args = prepare_server_args(
        ["--model-path", model_dir, *CPU, "--sparse-enabled", "false", "--attention-backend", "triton"]
    )
    assert args.sparse.enabled is False
    assert args.attention_backend == "triton"


def test_explicit_sparse_backend_accepted(model_dir):
    assert (
        prepare_server_args(["--model-path", model_dir, *CPU, "--attention-backend", "sparse"]).attention_backend
        == "sparse"
    )


def test_server_args_survive_the_spawn_pickle(model_dir):
    import pickle

    args = prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-token-budget", "4096"])
    clone = pickle.loads(pickle.dumps(args))
    assert type(clone) is SparseServerArgs and clone.sparse == args.sparse


def test_config_file_carries_sparse_flags(model_dir, tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("sparse-token-budget: 512\nsparse-selector: mean\nmax-total-tokens: 4096\n")
    args = prepare_server_args(["--model-path", model_dir, *CPU, "--config", str(config)])
    assert (args.sparse.token_budget, args.sparse.selector, args.max_total_tokens) == (512, "mean", 4096)


def test_help_lists_sglang_and_sparse_flags():
    text = build_parser().format_help()
    for flag in (
        "--model-path",
        "--max-total-tokens",
        "--chunked-prefill-size",
        "--attention-backend",
        "--sparse-enabled",
        "--sparse-page-size",
        "--sparse-token-budget",
        "--sparse-selector",
        "--sparse-sink-pages",
        "--sparse-recent-pages",
        "--sparse-working-set-window",
        "--sparse-gpu-cache-gb",
        "--sparse-host-cache-gb",
        "--sparse-max-inject-tokens",
    ):
        assert flag in text, flag


BAD_ARGV = [
    (["--sparse-token-budget", "-1"], "--sparse-token-budget"),
    (["--sparse-token-budget", "2050"], "--sparse-token-budget"),
    (["--sparse-page-size", "48"], "--sparse-page-size"),
    (["--sparse-page-size", "abc"], "--sparse-page-size"),
    (["--sparse-selector", "oracle"], "--sparse-selector"),
    (["--sparse-host-cache-gb", "1000000"], "--sparse-host-cache-gb"),
    (["--sparse-gpu-cache-gb", "-3"], "--sparse-gpu-cache-gb"),
    (["--sparse-recent-pages", "0"], "--sparse-recent-pages"),
    (["--sparse-working-set-window", "0"], "--sparse-working-set-window"),
    (["--sparse-max-inject-tokens", "-5"], "--sparse-max-inject-tokens"),
    (["--sparse-tbt-target-ms", "-5"], "--sparse-tbt-target-ms"),
    (["--sparse-tbt-target-ms", "80"], "--sparse-tbt-target-ms"),  # without segmented or interleaved prefill
    # paced chunks with chunked prefill off, or smaller than a paced chunk's unit
    (
        ["--sparse-tbt-target-ms", "80", "--sparse-interleave-prefill", "true", "--chunked-prefill-size", "-1"],
        "--chunked-prefill-size",
    ),
    (
        ["--sparse-tbt-target-ms", "80", "--sparse-interleave-prefill", "true", "--chunked-prefill-size", "32"],
        "--chunked-prefill-size",
    ),
    (["--dp-size", "2", "--enable-dp-attention"], "--enable-dp-attention"),
    (["--pp-size", "2"], "--pp-size"),
    (["--tokenizer-worker-num", "2"], "--tokenizer-worker-num"),
    (["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
    (["--enable-pdmux"], "--enable-pdmux"),
    (["--sparse-enabled", "maybe"], "--sparse-enabled"),
    (["--attention-backend", "flashinfer"], "--attention-backend"),
    (["--decode-attention-backend", "triton"], "--decode-attention-backend"),
    (["--max-total-tokens", "many"], "--max-total-tokens"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--model-path", "/nonexistent/model"], "--model-path"),
]


@pytest.mark.parametrize("argv,flag", BAD_ARGV, ids=[" ".join(a) for a, _ in BAD_ARGV])
def test_bad_flag_is_one_line_and_status_2(argv, flag, model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch_server.main(["--model-path", model_dir, *CPU, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("python -m sparse_sglang.launch_server: error: ")
    assert flag in err


def test_missing_default_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSE_SGLANG_CACHE", str(tmp_path))
    monkeypatch.setenv("SPARSE_SGLANG_DEFAULT_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(CLIError, match="--model-path: .*missing.gguf"):
        prepare_server_args(CPU)


def _run_entry(*argv: str) -> subprocess.CompletedProcess:
    # This checkout's launcher, not the one pip installed (an editable install may be another checkout).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "sparse_sglang.launch_server", *argv], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip


def test_real_entry_bad_flag_exits_2_with_one_line():
    proc = _run_entry("--sparse-token-budget", "100", "--sparse-page-size", "32")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "python -m sparse_sglang.launch_server: error: "
        "--sparse-token-budget: must be a multiple of --sparse-page-size (32), got 100"
    ]
    assert proc.stdout == ""


def test_real_entry_help():
    proc = _run_entry("--help")
    assert proc.returncode == 0
    assert "--sparse-token-budget" in proc.stdout and "--tensor-parallel-size" in proc.stdout


def test_server_args_built_in_code_route_the_same_way(model_dir):
    # The offline Engine builds SparseServerArgs from keyword arguments, not from the CLI.
    args = SparseServerArgs(model_path=model_dir, device="cpu", sparse={"token_budget": 1024})
    assert args.sparse == SparseConfig(token_budget=1024, host_cache_gb=args.sparse.host_cache_gb)
    assert args.attention_backend == "sparse"
    # in code, a refused SGLang argument is named as the keyword it is (the CLI names the flag)
    with pytest.raises(ValueError, match=r"^attention_backend='fa3': sparse decode needs 'sparse' .*sparse\.enabled"):
        SparseServerArgs(model_path=model_dir, device="cpu", attention_backend="fa3")
    with pytest.raises(ValueError, match=r"^pp_size=2: sparse decode does not split a model's layers"):
        SparseServerArgs(model_path=model_dir, device="cpu", pp_size=2)
    # tensor parallelism is SGLang's too: each rank keeps its own kv heads' hierarchy
    assert SparseServerArgs(model_path=model_dir, device="cpu", tp_size=2).tp_size == 2
    # data parallelism is SGLang's: replicas of the whole hierarchy, the host store split between them
    assert SparseServerArgs(model_path=model_dir, device="cpu", dp_size=2).dp_size == 2
    with pytest.raises(ValueError, match=r"^page_size=64: .*set sparse\.page_size 64"):
        SparseServerArgs(model_path=model_dir, device="cpu", page_size=64)


def test_fp8_kv_scales_must_cover_every_tp_rank(model_dir):
    # SGLang runs a rank at scale 1.0 when the file lacks its scales: refused before anything starts
    one = str(REPO / "benchmark" / "kv-scales-llama3-8b-dummy.json")
    two = str(REPO / "benchmark" / "kv-scales-llama3-8b-dummy-tp2.json")
    fp8 = {"model_path": model_dir, "device": "cpu", "kv_cache_dtype": "fp8_e4m3"}
    assert SparseServerArgs(**fp8, quantization_param_path=one).quantization_param_path == one
    assert SparseServerArgs(**fp8, quantization_param_path=two, tp_size=2).tp_size == 2
    with pytest.raises(ValueError, match=r"^quantization_param_path=.*rank\(s\) 0; --tp-size 2 needs exactly 0, 1"):
        SparseServerArgs(**fp8, quantization_param_path=one, tp_size=2)
    with pytest.raises(ValueError, match=r"^quantization_param_path=.*rank\(s\) 0, 1; --tp-size 1 needs exactly 0 "):
        SparseServerArgs(**fp8, quantization_param_path=two)
    with pytest.raises(ValueError, match=r"^quantization_param_path='/nonexistent.json': not a KV scales file"):
        SparseServerArgs(**fp8, quantization_param_path="/nonexistent.json")
    # SGLang reads the file for fp8_e4m3 KV only
    assert SparseServerArgs(model_path=model_dir, device="cpu", quantization_param_path=two).tp_size == 1


def test_the_xqa_kernel_needs_fp8_kv(model_dir):
    xqa = {"model_path": model_dir, "device": "cpu", "sparse": {"decode_kernel": "xqa"}}
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='auto': sparse\.decode_kernel xqa attends fp8 KV only"):
        SparseServerArgs(**xqa)
    assert SparseServerArgs(**xqa, kv_cache_dtype="fp8_e4m3").sparse.decode_kernel == "xqa"


def test_engine_is_sglangs_engine_with_our_args_and_scheduler():
    from sglang.srt.entrypoints.engine import Engine as SGLangEngine

    import sparse_sglang
    from sparse_sglang.integration.scheduler_process import run_scheduler_process

    assert issubclass(sparse_sglang.Engine, SGLangEngine)
    assert sparse_sglang.Engine.server_args_class is SparseServerArgs
    assert sparse_sglang.Engine.run_scheduler_process_func is run_scheduler_process


def test_sparse_config_errors_in_code_name_the_field(model_dir):
    # The offline Engine's ``sparse={...}``: the field as the caller wrote it, not the CLI flag.
    from sparse_sglang.config import SparseConfigError

    with pytest.raises(SparseConfigError, match=r"^sparse\.token_budget: must be positive, got -1$"):
        SparseServerArgs(model_path=model_dir, device="cpu", sparse={"token_budget": -1})
    with pytest.raises(SparseConfigError, match=r"^sparse\.token_budget: must be a multiple of sparse\.page_size"):
        SparseServerArgs(model_path=model_dir, device="cpu", sparse={"token_budget": 100})
    with pytest.raises(SparseConfigError, match=r"^sparse\.tokens_budget: is not a sparse knob"):
        SparseServerArgs(model_path=model_dir, device="cpu", sparse={"tokens_budget": 1024})


def test_no_gpu_fails_before_the_default_model_is_converted(monkeypatch, capsys):
    import torch

    from sparse_sglang import default_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(default_model, "default_model_path", lambda: pytest.fail("converted the default model"))
    with pytest.raises(SystemExit) as exit_info:
        launch_server.main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"python -m sparse_sglang.launch_server: error: {NO_GPU}"]
    with pytest.raises(SystemExit):  # --device is named where it was typed
        launch_server.main(["--device", "cuda"])
    assert capsys.readouterr().err.splitlines() == [
        f"python -m sparse_sglang.launch_server: error: --device cuda: {NO_GPU}"
    ]


# Without a GPU neither sparse nor plain SGLang serves: the line suggests no flag, only where to look.
NO_GPU = ("sparse-sglang needs an NVIDIA GPU with CUDA; none is visible to torch (torch.cuda.is_available() is "
          "False; check nvidia-smi and CUDA_VISIBLE_DEVICES)")  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the server would start")
def test_real_entry_without_a_gpu_is_one_line_naming_no_untyped_flag(model_dir):
    proc = _run_entry("--model-path", model_dir, "--sparse-token-budget", "1024")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"python -m sparse_sglang.launch_server: error: {NO_GPU}"]


def test_engine_without_model_path_serves_the_default_model(monkeypatch, tmp_path):
    import torch
    from sglang.srt.entrypoints.engine import Engine as SGLangEngine

    import sparse_sglang
    from sparse_sglang import default_model
    from sparse_sglang.integration.server_args import NoUsableGPU

    started = {}
    monkeypatch.setattr(SGLangEngine, "__init__", lambda self, **kwargs: started.update(kwargs))
    monkeypatch.setattr(default_model, "default_model_path", lambda: str(tmp_path / "smollm2"))
    sparse_sglang.Engine(device="cpu", sparse={"token_budget": 1024})
    assert started["model_path"] == str(tmp_path / "smollm2") and started["sparse"] == {"token_budget": 1024}
    sparse_sglang.Engine(model_path="/given", device="cpu")
    assert started["model_path"] == "/given"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoUsableGPU, match=r"^sparse_sglang\.Engine needs an NVIDIA GPU with CUDA; none is visible"):
        sparse_sglang.Engine()
    monkeypatch.setattr(default_model, "default_model_path", lambda: (_ for _ in ()).throw(
        default_model.DefaultModelUnavailable("no --model-path given and the default model is not installed")))  # fmt: skip
    with pytest.raises(default_model.DefaultModelUnavailable, match="^model_path: "):
        sparse_sglang.Engine(device="cpu")


def test_engine_checks_for_a_gpu_first_whatever_its_arguments(monkeypatch):
    from sglang.srt.entrypoints.engine import Engine as SGLangEngine

    import sparse_sglang
    from sparse_sglang.integration.server_args import NoUsableGPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(SGLangEngine, "__init__", lambda self, **kwargs: pytest.fail("SGLang's Engine started"))
    for kwargs, named in (({"model_path": "/given"}, "sparse_sglang.Engine"),
                          ({"sparse": {"token_budget": -1}}, "sparse_sglang.Engine"),  # before the config's checks
                          ({"model_path": "/given", "device": "cuda"}, "sparse_sglang.Engine(device='cuda')")):  # fmt: skip
        with pytest.raises(NoUsableGPU) as raised:
            sparse_sglang.Engine(**kwargs)
        assert str(raised.value) == f"{named} needs {NO_GPU.split(' needs ', 1)[1]}"
    monkeypatch.setattr(SGLangEngine, "__init__", lambda self, **kwargs: None)
    sparse_sglang.Engine(model_path="/given", sparse=SparseConfig(enabled=False))  # plain SGLang: its own checks


def _indented_block_around(markdown: str, needle: str) -> str:
    """The indented code block of ``markdown`` whose lines include ``needle``, blank lines and all."""
    lines = markdown.splitlines()
    at = next(i for i, line in enumerate(lines) if needle in line and line.startswith("    "))
    start, end = at, at
    while start > 0 and (lines[start - 1].startswith("    ") or not lines[start - 1].strip()):
        start -= 1
    while end + 1 < len(lines) and (lines[end + 1].startswith("    ") or not lines[end + 1].strip()):
        end += 1
    return "\n".join(lines[start : end + 1]).strip("\n")


def test_the_documented_engine_example_without_a_gpu_is_one_clear_exception(monkeypatch, tmp_path):
    """docs/serving.md's Engine example, run as written on a machine without a GPU: one exception,
    one line, naming no CLI flag, with no chained cause or context to print a second traceback."""
    from sglang.srt.entrypoints.engine import Engine as SGLangEngine

    from sparse_sglang import default_model
    from sparse_sglang.integration.server_args import NoUsableGPU

    text = (REPO / "docs" / "serving.md").read_text()
    block = _indented_block_around(text, "sparse_sglang.Engine(")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(default_model, "default_model_path", lambda: str(tmp_path / "smollm2"))
    monkeypatch.setattr(SGLangEngine, "__init__", lambda self, **kwargs: pytest.fail("SGLang's Engine started"))
    with pytest.raises(NoUsableGPU) as raised:
        exec(textwrap.dedent(block), {})
    message = str(raised.value)
    assert message == f"sparse_sglang.Engine needs {NO_GPU.split(' needs ', 1)[1]}" and "--" not in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_help_prints_the_sparse_flags_first_with_their_choices():
    from sparse_sglang.integration.server_args import build_parser

    text = build_parser().format_help()
    sparse_at, sglang_at = text.index("sparse-sglang:"), text.index("--tokenizer-path")
    assert sparse_at < sglang_at and text.index("--sparse-enabled") < sglang_at
    assert "--sparse-selector {quest,arkvale,mean,sketch}" in text and "--sparse-group-reduce {sum,max}" in text
    assert len(text[:sparse_at].splitlines()) < 10  # the usage line does not list SGLang's 400 flags


def test_the_sketch_selector_finds_its_key_basis_or_says_how_to_make_one(model_dir, tmp_path):
    """Resolved once by the launcher: the model folder's basis file, a random one for dummy
    weights, else a one-line refusal naming the flag and the command that fits one."""
    import shutil

    from sparse_sglang.mem_cache.key_sketch import BASIS_FILE, KeyBasis

    sketch = {"selector": "sketch"}
    with pytest.raises(
        ValueError, match=r"^model_path=.*python -m sparse_sglang\.calibrate --model-path .*sparse\.key_basis"
    ):
        SparseServerArgs(model_path=model_dir, device="cpu", sparse=sketch)
    assert (
        SparseServerArgs(model_path=model_dir, device="cpu", sparse=sketch, load_format="dummy").sparse.key_basis
        is None
    )
    folder = tmp_path / "with-basis"
    shutil.copytree(model_dir, folder)
    KeyBasis.random(32, 8, 128, 32).save(folder / BASIS_FILE)
    args = SparseServerArgs(model_path=str(folder), device="cpu", sparse=sketch)
    assert args.sparse.key_basis == str(folder / BASIS_FILE)
    # the CLI names the flags
    with pytest.raises(CLIError, match=r"^--model-path .*--sparse-key-basis FILE"):
        prepare_server_args(["--model-path", model_dir, *CPU, "--sparse-selector", "sketch"])
