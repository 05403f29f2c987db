import json

from conveyor.cli import build_parser, main


def test_bench_subcommand_is_registered():
    args = build_parser().parse_args(["bench", "--concurrency", "1,2"])
    assert args.concurrency == "1,2" and callable(args.func)


def test_end_to_end_sweep_writes_reports(fake_server, tmp_path, capsys):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    code = main(["bench", "--url", fake_server.url + "/v1", "--concurrency", "1,4", "--num-requests", "8",
                 "--prompt-tokens", "16", "--max-tokens", "8", "--endpoint", "completions", "--no-progress",
                 "--roofline-gflops", "100", "--model-params", "135M", "--api-key", "sk-secret",
                 "--output-json", str(out_json), "--output-md", str(out_md)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fake-model" in printed and "% roofline" in printed  # model from /v1/models
    assert printed == out_md.read_text() + "\n"
    assert "sk-secret" not in out_json.read_text()
    data = json.loads(out_json.read_text())
    assert data["config"]["concurrency_levels"] == [1, 4]
    assert [lvl["num_output_tokens"] for lvl in data["levels"]] == [64, 64]
    assert all(b["model"] == "fake-model" for b in fake_server.state.bodies)
    assert set(fake_server.state.auth_headers) == {"Bearer sk-secret"}


def test_roofline_uses_the_servers_param_count(fake_server, tmp_path):
    """No --model-params: the model card's meta.n_params (llama-server's field) sizes the roofline."""
    fake_server.state.n_params = 135_000_000
    out_json = tmp_path / "r.json"
    assert main(["bench", "--url", fake_server.url, "--concurrency", "1", "--num-requests", "2", "--max-tokens", "4",
                 "--no-progress", "--roofline-gflops", "100", "--output-json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["roofline"]["gflops_per_token"] == 0.27
    assert data["levels"][0]["roofline_fraction"] is not None


def test_consistency_gate_exit_code(fake_server, capsys):
    argv = ["bench", "--url", fake_server.url, "--check-consistency", "--concurrency", "1,4",
            "--num-requests", "8", "--max-tokens", "4", "--no-progress"]
    assert main(argv) == 0
    fake_server.state.nondeterministic = True
    assert main(argv) == 1
    assert "FAIL" in capsys.readouterr().out


def test_scenario_via_cli(fake_server, capsys):
    code = main(["bench", "--url", fake_server.url, "--scenario", "long-prompt-admission", "--streams", "2",
                 "--long-prompt-tokens", "64", "--max-tokens", "20", "--ignore-eos", "--no-progress"])
    assert code == 0 and "Long-prompt admission" in capsys.readouterr().out


def test_all_requests_failing_exits_1(fake_server):
    fake_server.state.fail_every = 1
    assert main(["bench", "--url", fake_server.url, "--concurrency", "2", "--num-requests", "2",
                 "--no-progress"]) == 1


def test_unusable_runs_exit_2(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", "--no-progress"]) == 2  # nothing listens
    assert main(["bench", "--concurrency", "0"]) == 2
    assert "concurrency" in capsys.readouterr().err
