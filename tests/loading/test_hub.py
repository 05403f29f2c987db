"""`--model ORG/NAME[:QUANT]` against a Hugging Face Hub stand-in on loopback (no hub is reachable here).

The stand-in answers the routes huggingface_hub 2.4 calls: the repo info, the tree listing, and HEAD/GET of
/resolve/ with the headers the client requires (X-Repo-Commit, ETag, Content-Length; no X-Xet-Hash, so
plain HTTP downloads). The library is pointed at it through its constants, which it reads at import.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import gguf
import huggingface_hub.constants as hf_constants
import pytest
import torch

from conveyor.cli import build_parser
from conveyor.config import ConfigError, EngineConfig, load_configs
from conveyor.loading import LoadError, load_checkpoint
from conveyor.loading import hub
from conveyor.loading.checkpoint import QuantizedTensor
from conveyor.testing import write_tiny_gguf, write_tiny_model_dir

Q = gguf.GGMLQuantizationType
_ROUTES = (
    ("info", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)")),
    ("tree", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)")),
    ("file", re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")),
)


@dataclass
class FakeHub:
    """Repos of in-memory files; `private` repos answer 401 as the Hub does without a token."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    private: set[str] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)

    @staticmethod
    def sha(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def answer(self, method: str, url: str) -> tuple[int, dict[str, str], bytes]:
        self.requests.append(f"{method} {url}")
        path = unquote(urlsplit(url).path)
        for kind, pattern in _ROUTES:
            match = pattern.fullmatch(path)
            if match:
                return self._route(kind, match)
        return 404, {}, b"no route"

    def _route(self, kind: str, match: re.Match) -> tuple[int, dict[str, str], bytes]:
        repo, rev = match["repo"], match["rev"]
        if repo in self.private:
            return 401, {"X-Error-Message": "Unauthorized"}, b"{}"
        if repo not in self.repos:
            return 404, {"X-Error-Code": "RepoNotFound"}, b"{}"
        if rev not in ("main", self.sha(repo)):
            return 404, {"X-Error-Code": "RevisionNotFound"}, b"{}"
        files, commit = self.repos[repo], {"X-Repo-Commit": self.sha(repo)}
        if kind == "info":
            body = {"id": repo, "sha": self.sha(repo), "siblings": [{"rfilename": name} for name in files]}
            return 200, commit, json.dumps(body).encode()
        if kind == "tree":
            body = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in files.items()]
            return 200, commit, json.dumps(body).encode()
        if match["path"] not in files:
            return 404, {**commit, "X-Error-Code": "EntryNotFound"}, b"{}"
        data = files[match["path"]]
        return 200, {**commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, data


def _handler(fake: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, with_body: bool) -> None:
            status, headers, body = fake.answer(self.command, self.path)
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self._reply(with_body=False)

        def do_GET(self) -> None:
            self._reply(with_body=True)

        def log_message(self, *args) -> None:  # quiet test output
            pass

    return Handler


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("repos")
    hf_dir = _tree(Path(write_tiny_model_dir(root / "hf")))
    hf_dir["pytorch_model.bin"] = b"legacy weights conveyor never reads"
    hf_dir["README.md"] = b"# tiny"
    (root / "gguf").mkdir()
    quants = {f"tiny-{t.name}.gguf": Path(write_tiny_gguf(root / "gguf" / f"tiny-{t.name}.gguf", t)).read_bytes()
              for t in (Q.Q8_0, Q.Q4_0)}
    (root / "split").mkdir()
    write_tiny_gguf(root / "split" / "tiny-Q8_0.gguf", Q.Q8_0, split_max_tensors=8)  # as gguf-split writes it
    split = {p.name: p.read_bytes() for p in sorted((root / "split").iterdir())}
    return {
        "org/tiny": hf_dir,
        "org/tiny-GGUF": {**quants, "README.md": b"# quants"},
        "org/private": hf_dir,
        "org/readme-only": {"README.md": b"# nothing to load"},
        "org/split-GGUF": split,
        "org/broken-split-GGUF": {"tiny-Q8_0-00001-of-00003.gguf": b"part 1", "tiny-Q8_0-00003-of-00003.gguf": b"3"},
    }


@pytest.fixture
def fake_hub(repos, tmp_path, monkeypatch):
    fake = FakeHub(repos=repos, private={"org/private"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(hf_constants, "ENDPOINT", url)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    fake.stop = lambda: (server.shutdown(), server.server_close())
    yield fake
    server.shutdown()
    server.server_close()
    thread.join()


def _go_offline(fake: FakeHub, monkeypatch) -> None:
    fake.stop()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)


def test_safetensors_repo_downloads_what_loading_needs_and_loads_offline_later(fake_hub, monkeypatch):
    folder = Path(hub.resolve_model("org/tiny"))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]
    assert str(folder).startswith(hf_constants.HF_HUB_CACHE)  # the standard cache, shared with other tools
    online = load_checkpoint("org/tiny")
    assert online.config.architecture == "llama" and online.weights

    _go_offline(fake_hub, monkeypatch)
    asked = len(fake_hub.requests)
    offline = load_checkpoint("org/tiny")
    assert len(fake_hub.requests) == asked  # no request at all, not even a refused one
    assert set(offline.weights) == set(online.weights)


def test_quant_picks_the_gguf_file_and_offline_picks_it_again(fake_hub, monkeypatch):
    path = hub.resolve_model("org/tiny-GGUF:q8_0")  # case-insensitive, as llama-server's -hf
    assert Path(path).name == "tiny-Q8_0.gguf"
    assert not (Path(path).parent / "tiny-Q4_0.gguf").exists()  # only the file asked for
    checkpoint = load_checkpoint("org/tiny-GGUF:Q8_0")
    assert checkpoint.name == "tiny"  # the file's name, not the hash of the cache blob it links to
    weight = checkpoint.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(weight, QuantizedTensor) and weight.qtype == Q.Q8_0

    _go_offline(fake_hub, monkeypatch)
    assert hub.resolve_model("org/tiny-GGUF:Q8_0") == path
    with pytest.raises(LoadError, match="not .*in the Hugging Face cache"):
        hub.resolve_model("org/tiny-GGUF:Q4_0")  # listed in the cache, never downloaded


def test_hf_file_and_revision_select_like_the_flags(fake_hub):
    sha = FakeHub.sha("org/tiny-GGUF")
    path = hub.resolve_model("org/tiny-GGUF", hf_file="tiny-Q4_0.gguf", revision=sha)
    assert Path(path).name == "tiny-Q4_0.gguf" and sha in path
    with pytest.raises(LoadError, match="no revision 'v9'"):
        hub.resolve_model("org/tiny", revision="v9")
    with pytest.raises(LoadError, match="has no file nope.gguf; files: README.md, tiny-Q4_0.gguf"):
        hub.resolve_model("org/tiny-GGUF", hf_file="nope.gguf")


@pytest.mark.parametrize(("spec", "words"), [
    ("org/missing", "no such model repo on http://127.0.0.1"),
    ("org/private", r"refused access \(401\).*set HF_TOKEN"),
    ("org/readme-only", r"no usable model files .*files: README.md"),
    ("org/tiny-GGUF", "several GGUF files match; pick one with ORG/NAME:QUANT or --hf-file: tiny-Q4_0.gguf, tiny-Q8_0.gguf"),
    ("org/tiny-GGUF:Q5_K", "no GGUF file matches :Q5_K; pick one .*: tiny-Q4_0.gguf, tiny-Q8_0.gguf$"),
    ("org/broken-split-GGUF", r"one part of a split GGUF whose other parts are not in the repo: "
                              r"tiny-Q8_0-00002-of-00003.gguf"),
])
def test_errors_are_one_line_that_says_what_to_do(fake_hub, spec, words):
    with pytest.raises(LoadError, match=words) as info:
        load_checkpoint(spec)
    assert "\n" not in str(info.value)


def test_offline_and_not_cached_says_so(fake_hub, monkeypatch):
    _go_offline(fake_hub, monkeypatch)
    with pytest.raises(LoadError, match="HF_HUB_OFFLINE is set and the model is not in the Hugging Face cache"):
        load_checkpoint("org/tiny")
    assert fake_hub.requests == []


def test_full_disk_is_a_load_error(fake_hub, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub, "snapshot_download", full)
    with pytest.raises(LoadError, match="no space left .*point HF_HOME to a larger disk"):
        hub.resolve_model("org/tiny")


def test_local_paths_are_not_hub_names(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "HfApi", None)  # any Hub call would fail loudly
    folder = write_tiny_model_dir(tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_model("org/tiny") == "org/tiny"  # an existing relative path wins over the Hub name
    assert hub.resolve_model(folder) == folder and hub.resolve_model(None) is None
    assert hub.resolve_model("not a repo id") == "not a repo id"  # left for load_checkpoint to report
    with pytest.raises(LoadError, match="apply to Hugging Face Hub names"):
        hub.resolve_model(folder, revision="main")


def test_cli_spellings_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "-hf", "org/tiny-GGUF:Q8_0", "--revision", "v1"])
    engine, _ = load_configs(args, env={})
    assert (engine.model, engine.revision, engine.hf_file) == ("org/tiny-GGUF:Q8_0", "v1", None)
    args = build_parser().parse_args(["generate", "--hf-repo", "org/tiny-GGUF", "--hf-file", "tiny-Q4_0.gguf", "-p", "hi"])
    engine, _ = load_configs(args, env={})
    assert (engine.model, engine.hf_file) == ("org/tiny-GGUF", "tiny-Q4_0.gguf")
    with pytest.raises(ConfigError, match="need a Hugging Face Hub name"):
        EngineConfig(hf_file="tiny-Q4_0.gguf")


def test_gguf_choice_without_quant_prefers_llama_servers_default_and_skips_projectors():
    files = ["README.md", "x-Q4_K_M.gguf", "x-Q8_0.gguf", "mmproj-x-f16.gguf"]
    assert hub._pick_gguf(hub.HubSpec("org/x-GGUF"), files) == "x-Q4_K_M.gguf"
    assert hub._pick_gguf(hub.HubSpec("org/x-GGUF", quant="Q8_0"), files) == "x-Q8_0.gguf"
    assert hub._pick_gguf(hub.HubSpec("org/x-GGUF"), ["x-Q8_0.gguf", "mmproj-x-f16.gguf"]) == "x-Q8_0.gguf"
    assert hub.parse_hub_spec("org/x-GGUF:Q8_0") == hub.HubSpec("org/x-GGUF", "Q8_0")
    assert hub.parse_hub_spec("./models/x") is None and hub.parse_hub_spec("a/b/c") is None


def test_pull_ls_rm_manage_the_cache(fake_hub, capsys):
    from conveyor.cli import main

    assert main(["pull", "org/tiny-GGUF:Q8_0"]) == 0
    path = capsys.readouterr().out.strip()
    assert path.endswith("tiny-Q8_0.gguf") and os.path.isfile(path)
    assert main(["ls"]) == 0
    listed = capsys.readouterr().out
    assert "org/tiny-GGUF" in listed and "tiny-Q8_0.gguf" in listed and "tiny-Q4_0.gguf" not in listed
    assert main(["rm", "org/tiny-GGUF:Q8_0"]) == 0
    assert "removed org/tiny-GGUF" in capsys.readouterr().out and not os.path.exists(path)
    assert main(["ls"]) == 0 and "org/tiny-GGUF" not in capsys.readouterr().out
    assert main(["rm", "org/tiny-GGUF"]) == 1
    assert "not in the Hugging Face cache" in capsys.readouterr().err
    assert main(["pull", "org/nope"]) == 1 and "no such model repo" in capsys.readouterr().err
    assert main(["pull", "not a name"]) == 2


def test_download_progress_reaches_the_load_progress_that_health_shows(fake_hub):
    from conveyor.engine.load_progress import LoadProgress

    reports: list[tuple[int, int]] = []
    progress = LoadProgress(show_bar=False)

    def report(done: int, total: int) -> None:
        reports.append((done, total))
        progress.download(done, total)

    hub.resolve_model("org/tiny", on_download=report)
    total = reports[-1][1]
    assert total > 0 and reports[-1][0] == total  # every byte of the snapshot, in order
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    view = progress.view()
    assert view["download"] == {"bytes": total, "bytes_total": total, "fraction": 1.0}
    assert view["stage"] == "reading the checkpoint"  # the download is over; the load goes on
    reports.clear()
    hub.resolve_model("org/tiny", on_download=report)  # cached: nothing to download, nothing reported
    assert not reports or reports[-1][0] == reports[-1][1]


def test_a_split_gguf_downloads_every_part_and_loads_as_the_whole_file(fake_hub, repos, tmp_path):
    first = hub.resolve_model("org/split-GGUF")
    assert first.endswith("tiny-Q8_0-00001-of-00003.gguf")
    assert sorted(p.name for p in Path(first).parent.iterdir()) == sorted(repos["org/split-GGUF"])
    whole = load_checkpoint(write_tiny_gguf(tmp_path / "tiny-Q8_0.gguf", Q.Q8_0))
    split = load_checkpoint("org/split-GGUF:Q8_0")
    assert split.name == whole.name == "tiny" and set(split.weights) == set(whole.weights)
    assert all(torch.equal(getattr(split.weights[k], "raw", split.weights[k]), getattr(whole.weights[k], "raw", whole.weights[k]))
               for k in whole.weights)
    # --hf-file may name any part
    assert hub.resolve_model("org/split-GGUF", hf_file="tiny-Q8_0-00002-of-00003.gguf") == first
