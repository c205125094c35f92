"""``gridserve bench peer``: variant names, the ratio per precision pair, the tables and JSON, CPU
by role, the GGUF cache, and a whole run against a stand-in llama-server (``fake_llama_server.py``:
no llama.cpp build needed) with the latency probe and the greedy tokens."""

from __future__ import annotations

import json
import math
import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from gridserve.benchmarks.cpu_by_process import cpu_used
from gridserve.benchmarks.llama_server import (
    LlamaServer,
    ensure_gguf,
    find_llama_server,
)
from gridserve.benchmarks.peer import cpu_by_role
from gridserve.benchmarks.peer_report import (
    GRIDSERVE,
    LLAMA_CPP,
    VariantError,
    cpu_table,
    greedy_agreement,
    greedy_line,
    pair_ratios,
    pairs_table,
    parse_range,
    parse_variant,
    parse_variants,
    variants_table,
)
from gridserve.benchmarks.peer_server import PeerSetupError
from gridserve.cli import main

FAKE_SERVER = Path(__file__).with_name("fake_llama_server.py")

# ---- variants ------------------------------------------------------------------------------------


def test_variant_names_say_server_pair_weights_kv_and_slots():
    fp32 = parse_variant("gridserve-fp32")
    assert (fp32.server, fp32.pair, fp32.weights, fp32.kv, fp32.engine_args) == (GRIDSERVE, "fp32", "fp32", "fp32", ())
    int8 = parse_variant("gridserve-int8")
    assert int8.pair == "int8" and int8.engine_args == ("--quantization", "int8", "--kv-cache-dtype", "bfloat16")
    q8 = parse_variant("lcpp-q8_0-np64")
    assert (q8.server, q8.pair, q8.weights, q8.kv, q8.slots) == (LLAMA_CPP, "int8", "q8_0", "f16", 64)
    f32 = parse_variant("lcpp-f32-kvf32-np256")
    assert (f32.pair, f32.weights, f32.kv, f32.slots) == ("fp32", "f32", "f32", 256)
    assert parse_variant("lcpp-f16-np8").pair == "f16"
    ngram = parse_variant("gridserve-fp32-ngram")
    assert ngram.pair == "fp32" and ngram.engine_args[0] == "--speculative-config"
    assert json.loads(ngram.engine_args[1])["method"] == "ngram"


@pytest.mark.parametrize("text", ["gridserve-fp16", "lcpp-q4_0-np64", "lcpp-f32", "lcpp-f32-np0", "lcpp-f32-np-1",
                                  "", "gridserve-fp32,gridserve-fp32"])
def test_unknown_or_repeated_variants_are_clear_errors(text):
    with pytest.raises(VariantError, match="--variants"):
        parse_variants(text)


def test_default_variants_cover_both_pairs_at_64_and_256_slots():
    from gridserve.benchmarks.peer_report import DEFAULT_VARIANTS

    variants = parse_variants(",".join(DEFAULT_VARIANTS))
    assert {(v.pair, v.server, v.slots) for v in variants} == {
        ("fp32", GRIDSERVE, None), ("fp32", LLAMA_CPP, 64), ("fp32", LLAMA_CPP, 256),
        ("int8", GRIDSERVE, None), ("int8", LLAMA_CPP, 64), ("int8", LLAMA_CPP, 256)}


def test_length_ranges():
    assert parse_range("32-256", "--output-lens") == (32, 256)
    assert parse_range("8", "--output-lens") == (8, 8)
    for bad in ("0-4", "9-8", "a-b", "1-2-3", ""):
        with pytest.raises(ValueError, match="--output-lens"):
            parse_range(bad, "--output-lens")


# ---- ratios, tables, greedy agreement ------------------------------------------------------------


def _result(name: str, tok_s: float, completed: int = 8, **run) -> dict:
    return {"variant": {**parse_variant(name).__dict__},
            "run": {"completed": completed, "failed": 0, "output_throughput": tok_s, "median_ttft_ms": 1500.0,
                    "p99_ttft_ms": 3000.4, **run}}


def test_each_pair_compares_gridserve_with_llama_cpps_best_setting():
    results = [_result("gridserve-fp32", 180.0), _result("lcpp-f32-np64", 90.0), _result("lcpp-f32-np256", 80.0),
               _result("gridserve-int8", 300.0), _result("lcpp-q8_0-np64", 200.0),
               _result("lcpp-q8_0-np256", 400.0, completed=0),  # failed entirely: nobody's best
               _result("lcpp-f16-np64", 120.0)]
    fp32, int8, f16 = pair_ratios(results)
    assert (fp32["pair"], fp32["llama_cpp_best"], fp32["ratio"]) == ("fp32", "lcpp-f32-np64", pytest.approx(2.0))
    assert (int8["llama_cpp_best"], int8["llama_cpp_tok_s"], int8["ratio"]) == ("lcpp-q8_0-np64", 200.0,
                                                                                 pytest.approx(1.5))
    assert (f16["gridserve"], f16["gridserve_tok_s"], f16["ratio"]) == (None, None, None)
    table = pairs_table([fp32, int8, f16])
    assert "| fp32 | gridserve-fp32 | 180.0 | - | - | - | lcpp-f32-np64 | 90.0 | **2.00x** |" in table
    assert "| f16 | - | - | - | - | - | lcpp-f16-np64 | 120.0 | - |" in table


def test_each_pair_compares_gridserve_with_vllm_and_int8_with_vllms_bf16():
    results = [_result("gridserve-fp32", 240.0), _result("vllm-fp32", 120.0), _result("gridserve-bf16", 300.0),
               _result("vllm-bf16", 250.0), _result("gridserve-int8", 500.0), _result("lcpp-q8_0-np64", 200.0)]
    fp32, bf16, int8 = pair_ratios(results)
    assert (fp32["vllm_best"], fp32["vllm_ratio"], fp32["ratio"]) == ("vllm-fp32", pytest.approx(2.0), None)
    assert (bf16["pair"], bf16["gridserve"], bf16["vllm_best"], bf16["vllm_ratio"]) == (
        "bf16", "gridserve-bf16", "vllm-bf16", pytest.approx(1.2))
    # vLLM's CPU build has no int8 path for an unquantized checkpoint: int8 is held to its bf16
    assert (int8["vllm_best"], int8["vllm_ratio"], int8["ratio"]) == ("vllm-bf16", pytest.approx(2.0),
                                                                      pytest.approx(2.5))
    assert "| bf16 | gridserve-bf16 | 300.0 | vllm-bf16 | 250.0 | **1.20x** | - | - | - |" in pairs_table([bf16])
    failed = {"variant": parse_variant("vllm-bf16").__dict__, "error": "PeerSetupError: no vllm"}
    (bf16,) = pair_ratios([_result("gridserve-bf16", 300.0), failed])
    assert bf16["vllm_best"] is None and bf16["vllm_ratio"] is None


def test_vllm_variants_and_their_pinned_server_command(tmp_path):
    from gridserve.benchmarks.vllm_server import VllmServer

    bf16, fp32 = parse_variant("vllm-bf16"), parse_variant("gridserve-bf16")
    assert (bf16.server, bf16.pair, bf16.weights, bf16.kv) == ("vllm", "bf16", "bf16", "bf16")
    assert fp32.engine_args == ("--dtype", "bfloat16")
    server = VllmServer(tmp_path / "vllm", tmp_path / "model", "bfloat16", kv_cache_gib=8)
    argv = server.argv()
    assert argv[:3] == [str(tmp_path / "vllm"), "serve", str(tmp_path / "model")]
    assert argv[argv.index("--max-num-seqs") + 1] == "256" and argv[argv.index("--max-model-len") + 1] == "512"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    env = server.env()
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert not Path(server.cwd()).resolve().is_relative_to(Path(__file__).resolve().parents[3])
    with pytest.raises(ValueError, match="dtype"):
        VllmServer(tmp_path / "vllm", tmp_path / "model", "float16")


def test_find_vllm_uses_the_venv_or_installs_it_with_the_shared_script(tmp_path):
    from gridserve.benchmarks.vllm_server import find_vllm

    with pytest.raises(PeerSetupError, match="--vllm"):
        find_vllm(str(tmp_path / "missing"), tmp_path / "venv", tmp_path)
    with pytest.raises(PeerSetupError, match="install.sh"):
        find_vllm(None, tmp_path / "venv", tmp_path / "no-scripts")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    _executable(scripts / "install.sh", '#!/bin/sh\nmkdir -p "$1/bin" && printf "#!/bin/sh\\n" > "$1/bin/vllm" '
                '&& chmod +x "$1/bin/vllm"\n')
    assert find_vllm(None, tmp_path / "venv", scripts) == tmp_path / "venv" / "bin" / "vllm"
    (scripts / "install.sh").write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(PeerSetupError, match="exit 3"):
        find_vllm(None, tmp_path / "venv2", scripts)


def test_a_pair_without_a_measured_peer_has_no_ratio():
    (fp32,) = pair_ratios([_result("gridserve-fp32", 180.0), {"variant": parse_variant("lcpp-f32-np64").__dict__,
                                                              "error": "PeerSetupError: no llama-server"}])
    assert fp32["ratio"] is None and fp32["llama_cpp_best"] is None and fp32["gridserve_tok_s"] == 180.0


def test_variants_table_has_one_row_each_with_probe_columns():
    results = [_result("gridserve-fp32", 176.84, median_probe_ttft_ms=812.2, p99_probe_ttft_ms=2400.9),
               {"variant": parse_variant("lcpp-f32-np64").__dict__, "error": "boom"}]
    lines = variants_table(results).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| gridserve-fp32 | gridserve | fp32 | fp32 | - | 8 / 0 | 176.8 | 1500 | 3000 | 812 | 2401 |"
    assert lines[3] == "| lcpp-f32-np64 | llama.cpp | f32 | f16 | 64 | 0 / - | - | - | - | - | - |"


def test_greedy_agreement_counts_identical_prompts_and_first_differences():
    tokens = {"gridserve-fp32": [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
              "lcpp-f32-np64": [[1, 2, 3], [4, 5, 6], [7, 0, 9]], "lcpp-f32-np256": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}
    agreement = greedy_agreement(tokens)
    assert agreement["prompts"] == 3
    assert agreement["variants"]["lcpp-f32-np64"] == {"identical": 2, "of": 3, "first_difference_at": [1]}
    assert agreement["variants"]["lcpp-f32-np256"]["identical"] == 3
    assert "lcpp-f32-np64 2/3, lcpp-f32-np256 3/3" in greedy_line(agreement)
    only = greedy_agreement({**tokens, "gridserve-int8": [[0]] * 3}, compare=["lcpp-f32-np256"])
    assert list(only["variants"]) == ["lcpp-f32-np256"]
    assert "not checked" in greedy_line(greedy_agreement({"lcpp-f32-np64": [[1]]}))


# ---- CPU by role ---------------------------------------------------------------------------------


def test_cpu_used_counts_deltas_and_whole_new_processes():
    before = {1: ("a", 10.0), 2: ("b", 5.0), 3: ("gone", 1.0)}
    after = {1: ("a", 12.5), 2: ("b", 5.1), 4: ("new", 3.0)}
    assert cpu_used(before, after, min_seconds=0.5) == {1: ("a", 2.5), 4: ("new", 3.0)}


def test_cpu_by_role_sums_the_servers_processes_the_client_and_the_rest():
    before = {10: ("envoy", 1.0), 11: ("py gateway", 2.0), 12: ("py engine", 0.0), 13: ("py worker", 50.0),
              99: ("bench", 3.0), 7: ("/usr/bin/cc1plus -quiet", 0.0)}
    after = {10: ("envoy", 2.0), 11: ("py gateway", 6.0), 12: ("py engine", 1.5), 13: ("py worker", 250.0),
             99: ("bench", 8.0), 7: ("/usr/bin/cc1plus -quiet", 20.0)}
    cpu = cpu_by_role(before, after, 100.0, {10: "envoy", 11: "gateway", 12: "engine", 13: "worker"}, me=99)
    assert cpu["by_role"] == {"client": 5.0, "engine": 1.5, "envoy": 1.0, "gateway": 4.0, "other": 20.0,
                              "worker": 200.0}
    assert cpu["other_top"] == [{"process": "cc1plus -quiet", "cpu_s": 20.0}]
    row = cpu_table([{"variant": parse_variant("gridserve-fp32").__dict__, "cpu": cpu}]).splitlines()[2]
    cores = os.cpu_count() or 1
    assert row.startswith("| gridserve-fp32 | 100.0 | 1.0 (") and f"200.0 ({100 * 200 / (100 * cores):.0f}%)" in row


# ---- llama.cpp: finding, converting, starting ----------------------------------------------------


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _fake_llama_server(tmp_path: Path) -> Path:
    return _executable(tmp_path / "llama-server", f"#!/bin/sh\nexec {sys.executable} {FAKE_SERVER} \"$@\"\n")


def _fake_scripts(tmp_path: Path) -> tuple[Path, Path]:
    """A scripts folder whose convert.sh writes 'GGUF <type>' and counts its runs; a work dir with
    the converter's venv in place (so nothing is built)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    _executable(scripts / "convert.sh", "#!/bin/sh\necho \"GGUF $4\" > \"$3\"\necho run >> \"$1/conversions\"\n")
    work = tmp_path / "work"
    (work / "cvenv" / "bin").mkdir(parents=True)
    (work / "cvenv" / "bin" / "python").write_text("")
    return scripts, work


def test_gguf_files_are_converted_once_and_again_when_the_checkpoint_changes(tmp_path):
    scripts, work = _fake_scripts(tmp_path)
    model = tmp_path / "llama-base"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = ensure_gguf(model, "q8_0", work, scripts)
    assert out == work / "gguf" / "llama-base-q8_0.gguf" and out.read_text() == "GGUF q8_0\n"
    assert ensure_gguf(model, "q8_0", work, scripts) == out
    assert (work / "conversions").read_text().count("run") == 1
    os.utime(model / "config.json", (out.stat().st_mtime + 10,) * 2)
    ensure_gguf(model, "q8_0", work, scripts)
    assert (work / "conversions").read_text().count("run") == 2
    with pytest.raises(ValueError, match="q4_0"):
        ensure_gguf(model, "q4_0", work, scripts)


def test_a_failed_conversion_names_its_log(tmp_path):
    scripts, work = _fake_scripts(tmp_path)
    _executable(scripts / "convert.sh", "#!/bin/sh\necho 'unknown pre-tokenizer' >&2\nexit 3\n")
    with pytest.raises(PeerSetupError, match="exit 3.*convert.log.*\n.*unknown pre-tokenizer"):
        ensure_gguf(tmp_path, "f32", work, scripts)


def test_llama_server_is_found_where_given_on_path_or_in_the_work_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(PeerSetupError, match="--llama-server .*not an executable"):
        find_llama_server(str(tmp_path / "nope"), tmp_path, tmp_path)
    built = tmp_path / "work" / "build" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    _executable(built, "#!/bin/sh\n")
    assert find_llama_server(None, tmp_path / "work", tmp_path) == built
    with pytest.raises(PeerSetupError, match="build.sh"):  # not built, and no scripts to build it
        find_llama_server(None, tmp_path / "other", tmp_path / "no-scripts")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    on_path = _executable(bindir / "llama-server", "#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(bindir))
    assert find_llama_server(None, tmp_path / "work", tmp_path) == on_path


def test_llama_server_argv_sizes_the_context_by_slots(tmp_path):
    server = LlamaServer(Path("/bin/llama-server"), Path("m.gguf"), 64, ctx_per_slot=512, kv_type="f32", threads=2)
    argv = server.argv()
    assert argv[:3] == ["/bin/llama-server", "-m", "m.gguf"]
    assert argv[-1] == "-cb"  # continuous batching
    with_extra = LlamaServer(Path("/bin/llama-server"), Path("m.gguf"), 1, extra_args=("-fa", "off")).argv()
    assert with_extra[-3:] == ["-cb", "-fa", "off"]
    flags = dict(zip(argv[3:-1:2], argv[4:-1:2]))
    assert flags["--host"] == "127.0.0.1" and int(flags["--port"]) == server.port
    assert (flags["-np"], flags["-c"], flags["-t"], flags["-ctk"], flags["-ctv"]) == ("64", "32768", "2", "f32", "f32")


def test_a_llama_server_that_dies_at_start_is_a_clear_error(tmp_path):
    binary = _executable(tmp_path / "llama-server", "#!/bin/sh\necho 'bad model' ; exit 4\n")
    server = LlamaServer(binary, tmp_path / "m.gguf", 4, log_path=tmp_path / "log")
    with pytest.raises(PeerSetupError, match="exited with 4"):
        server.start(timeout_s=30)
    assert "bad model" in (tmp_path / "log").read_text()


# ---- a whole run against the stand-in llama-server -----------------------------------------------


@pytest.mark.slow  # a whole run (make test; not make test-fast)
def test_bench_peer_runs_each_variant_with_probe_greedy_tokens_and_cpu(tmp_path, llama_tiny, monkeypatch):
    pytest.importorskip("matplotlib")
    scripts, work = _fake_scripts(tmp_path)
    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_log))
    out, png = tmp_path / "peer.json", tmp_path / "peer.png"
    rc = main(["bench", "peer", "--model", str(llama_tiny), "--variants", "lcpp-f32-np4,lcpp-q8_0-kvf32-np8",
               "--llama-server", str(_fake_llama_server(tmp_path)), "--llama-cpp-dir", str(work),
               "--peer-scripts", str(scripts), "--num-prompts", "6", "--input-lens", "8-16", "--output-lens", "3-5",
               "--probe-rate", "10", "--greedy-prompts", "2", "--greedy-tokens", "3", "--threads", "1",
               "--disable-tqdm", "--output-json", str(out), "--plot", str(png), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["variant"]["name"] for r in report["variants"]] == ["lcpp-f32-np4", "lcpp-q8_0-kvf32-np8"]
    assert report["workload"]["num_prompts"] == 6 and 8 <= report["workload"]["input_lens"][0]
    for r in report["variants"]:
        run = r["run"]
        assert (run["completed"], run["failed"]) == (6, 0) and run["output_throughput"] > 0
        assert run["probe_sent"] >= 1 and run["probe_completed"] == run["probe_sent"]
        assert run["median_probe_ttft_ms"] > 0
        assert r["cpu"]["wall_s"] > 0 and "llama-server" in r["cpu"]["by_role"] and "client" in r["cpu"]["by_role"]
        assert [len(t) for t in r["greedy_tokens"]] == [3, 3]  # the stand-in counts up from the prompt's last id
        assert all(t[1] == t[0] + 1 for t in r["greedy_tokens"])
        port = int(r["url"].rsplit(":", 1)[1])
        with socket.socket() as sock:  # stopped after its run
            assert sock.connect_ex(("127.0.0.1", port)) != 0
    started = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert [(a[a.index("-np") + 1], a[a.index("-ctk") + 1], Path(a[a.index("-m") + 1]).name) for a in started] == [
        ("4", "f16", f"{llama_tiny.name}-f32.gguf"), ("8", "f32", f"{llama_tiny.name}-q8_0.gguf"),
        ("1", "f32", f"{llama_tiny.name}-f32.gguf")]  # the greedy check: llama.cpp entirely in fp32
    assert started[2][-2:] == ["-fa", "off"]
    (fp32, int8) = report["pairs"]
    assert fp32["llama_cpp_best"] == "lcpp-f32-np4" and fp32["ratio"] is None  # no gridserve variant ran
    assert report["greedy"]["prompts"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not math.isnan(report["load_avg"][0])


def test_bench_peer_rejects_bad_settings_before_starting_anything(tmp_path, llama_tiny, capsys):
    for flags, field in ((["--variants", "lcpp-q4-np8"], "--variants"), (["--output-lens", "300-400"], "--ctx-per-slot"),
                         (["--input-lens", "0-3"], "--input-lens"), (["--greedy-tokens", "0"], "--greedy-tokens"),
                         (["--model", str(tmp_path)], "--model")):
        argv = ["bench", "peer", "--model", str(llama_tiny), "--output-json", str(tmp_path / "x.json"), *flags]
        assert main(argv) == 2
        assert field in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # a whole run (make test; not make test-fast)
def test_greedy_tokens_are_compared_with_gridserve_fp32s(tmp_path, llama_tiny, monkeypatch):
    """gridserve's server replaced by another stand-in (same greedy tokens): the fp32 pair's ratio
    and the greedy agreement of llama.cpp's f32 variant and of the all-fp32 check server."""
    import contextlib

    from gridserve.benchmarks import peer

    @contextlib.contextmanager
    def fake_gridserve(variant, setup, args):
        with LlamaServer(_fake_llama_server(tmp_path), llama_tiny, 1, log_path=tmp_path / "gs.log") as server:
            yield peer.Served(server.url, {server.process.pid: "worker"},
                              lambda requests: peer.llama_cpp_greedy(server.url, requests), ["fake"])

    monkeypatch.setattr(peer, "_gridserve", fake_gridserve)
    scripts, work = _fake_scripts(tmp_path)
    out = tmp_path / "peer.json"
    rc = main(["bench", "peer", "--model", str(llama_tiny), "--variants", "gridserve-fp32,lcpp-f32-np4",
               "--llama-server", str(_fake_llama_server(tmp_path)), "--llama-cpp-dir", str(work),
               "--peer-scripts", str(scripts), "--num-prompts", "3", "--output-lens", "2-3", "--probe-rate", "0",
               "--greedy-prompts", "2", "--greedy-tokens", "4", "--disable-tqdm", "--output-json", str(out),
               "--plot", "", "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["greedy"]["prompts"] == 2
    assert report["greedy"]["variants"] == {
        "lcpp-f32-np4": {"identical": 2, "of": 2, "first_difference_at": []},
        "lcpp-f32-kvf32-nofa-np1": {"identical": 2, "of": 2, "first_difference_at": []}}
    (fp32,) = report["pairs"]
    assert fp32["gridserve"] == "gridserve-fp32" and fp32["ratio"] == pytest.approx(
        fp32["gridserve_tok_s"] / fp32["llama_cpp_tok_s"])
    assert "probe_sent" not in report["variants"][0]["run"]  # --probe-rate 0: off
    assert "worker" in report["variants"][0]["cpu"]["by_role"]  # the server's processes, by role


@pytest.mark.slow  # a whole run (make test; not make test-fast)
def test_bench_peer_runs_vllm_variants_with_pinned_settings_and_greedy_tokens(tmp_path, llama_tiny, monkeypatch):
    pytest.importorskip("matplotlib")
    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_log))
    vllm = _executable(tmp_path / "vllm", f"#!/bin/sh\nexec {sys.executable} {FAKE_SERVER} \"$@\"\n")
    out = tmp_path / "peer.json"
    rc = main(["bench", "peer", "--model", str(llama_tiny), "--variants", "vllm-fp32,vllm-bf16", "--vllm", str(vllm),
               "--num-prompts", "4", "--input-lens", "8-16", "--output-lens", "3-5", "--probe-rate", "0",
               "--greedy-prompts", "2", "--greedy-tokens", "3", "--disable-tqdm", "--output-json", str(out),
               "--plot", "", "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    report = json.loads(out.read_text())
    for r in report["variants"]:
        assert (r["run"]["completed"], r["run"]["failed"]) == (4, 0)
        assert "vllm" in r["cpu"]["by_role"]
        assert all(t[1] == t[0] + 1 and len(t) == 3 for t in r["greedy_tokens"])
    started = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert [(a[0], a[1], a[a.index("--dtype") + 1], a[a.index("--max-num-seqs") + 1], a[a.index("--max-model-len") + 1])
            for a in started] == [("serve", str(llama_tiny), "float32", "256", "512"),
                                  ("serve", str(llama_tiny), "bfloat16", "256", "512")]
    fp32, bf16 = report["pairs"]
    assert (fp32["vllm_best"], bf16["vllm_best"]) == ("vllm-fp32", "vllm-bf16")
    assert fp32["vllm_ratio"] is None  # no gridserve variant ran
