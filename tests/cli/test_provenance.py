"""Result files name the code their process started with (wamrt.provenance.git_sha)."""

from __future__ import annotations

import subprocess

import wamrt.provenance as provenance


def test_git_sha_is_read_once_so_commits_made_during_a_long_run_do_not_relabel_its_results(monkeypatch) -> None:
    heads = iter(["a" * 40, "b" * 40])
    calls = []

    def fake_run(*args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout=next(heads) + "\n", stderr="")

    monkeypatch.delenv("WAMRT_GIT_SHA", raising=False)
    monkeypatch.setattr(provenance, "_head_at_first_call", None)
    monkeypatch.setattr(provenance.subprocess, "run", fake_run)
    assert provenance.git_sha() == "a" * 40
    assert provenance.git_sha() == "a" * 40  # HEAD moved to b...; the process still names a...
    assert len(calls) == 1
    monkeypatch.setenv("WAMRT_GIT_SHA", "c" * 40)  # the GPU machine's copy of the tree has no .git
    assert provenance.git_sha() == "c" * 40
