"""Result JSON names paths under the home directory as ``~/...`` (no machine's user in the repo)."""
import json
import os

from specserve.results import home_relative, write_json


def test_home_relative_rewrites_only_paths_under_home(monkeypatch):
    monkeypatch.setenv("HOME", "/home/alice")
    obj = {"gguf": "/home/alice/.cache/specserve/m.gguf", "home": "/home/alice", "other": "/home/alicebob/x",
           "rel": "docs/x.json", "n": 3, "nested": [("/home/alice/a", 1.5)],
           "command": "specserve bench --head /home/alice/h --json=/home/alice/r.json --x /mnt/home/alice/y /home/alicebob"}
    assert home_relative(obj) == {"gguf": "~/.cache/specserve/m.gguf", "home": "~", "other": "/home/alicebob/x",
                                  "rel": "docs/x.json", "n": 3, "nested": [["~/a", 1.5]],
                                  "command": "specserve bench --head ~/h --json=~/r.json --x /mnt/home/alice/y /home/alicebob"}


def test_write_json_creates_parents(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "a" / "b.json"
    write_json(out, {"head": os.path.join(str(tmp_path), "heads", "h")})
    assert json.loads(out.read_text()) == {"head": "~/heads/h"}
