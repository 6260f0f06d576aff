"""gpupack.token's pure parts: the files it writes are a kubeconfig the client layer loads (and
follows), and a token is replaced at half its remaining life. Against the real API server:
tests/security/test_extender_identity.py."""

from __future__ import annotations

import datetime as dt

from gpupack import kubeclient, token


def test_written_files_load_as_a_kubeconfig_that_follows_its_token(tmp_path):
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ca = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    token.write_files(tmp_path, token.Minted("first", now), "https://10.0.0.1:443", ca)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "kubeconfig", "token"]
    cfg = kubeclient.load_config(str(tmp_path / "kubeconfig"))
    assert cfg.host == "https://10.0.0.1:443" and cfg.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert cfg.get_api_key_with_prefix("BearerToken") == "Bearer first"
    token.write_files(tmp_path, token.Minted("second", now), "https://10.0.0.1:443", ca)
    assert cfg.get_api_key_with_prefix("BearerToken") == "Bearer second"
    # a token file gone for a moment keeps the one in hand (the API server judges it)
    (tmp_path / "token").unlink()
    assert cfg.get_api_key_with_prefix("BearerToken") == "Bearer second"


def inline_token_kubeconfig(d) -> str:
    """A kubeconfig whose user has an inline token (server http://127.0.0.1:1); its path."""
    (d / "kc").write_text(
        '{"apiVersion": "v1", "kind": "Config", "current-context": "c",'
        ' "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],'
        ' "users": [{"name": "u", "user": {"token": "inline"}}],'
        ' "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}'
    )
    return str(d / "kc")


def test_a_kubeconfig_with_an_inline_token_is_not_followed(tmp_path):
    cfg = kubeclient.load_config(inline_token_kubeconfig(tmp_path))
    assert cfg.get_api_key_with_prefix("BearerToken") == "Bearer inline"


def test_a_token_is_replaced_at_half_its_remaining_life():
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    minted = token.Minted("t", now + dt.timedelta(seconds=1800))
    assert token.refresh_at(minted, now) == now + dt.timedelta(seconds=900)


def test_bad_flags_are_refused_before_any_request(capsys):
    assert token.main(["--service-account", "x", "--namespace", "n", "--out-dir", "/nonexistent",
                       "--expiry-s", "60"]) == 2  # fmt: skip
    assert "at least 600" in capsys.readouterr().err
    assert token.main(["--service-account", "x", "--namespace", "n", "--out-dir", "/nonexistent",
                       "--pod-name", "p"]) == 2  # fmt: skip
    assert "go together" in capsys.readouterr().err


def test_the_librarys_credential_hook_runs_at_most_once_a_second():
    """The library's hook (inline, exec or in-cluster tokens) re-sets the configuration before every
    request; throttled, it still runs on the first request and once a second after."""
    calls: list[float] = []
    t = [100.0]
    hook = kubeclient.throttled(lambda c: calls.append(t[0]), 1.0, clock=lambda: t[0])
    for dt_s in (0.0, 0.25, 0.5, 0.5, 0.125, 2.0):
        t[0] += dt_s
        hook(None)
    assert calls == [100.0, 101.25, 103.375]


def test_a_kubeconfigs_library_hook_is_throttled(tmp_path):
    """With an inline token the library's hook re-sets the host before a request; after it ran,
    requests within the second leave the configuration alone."""
    cfg = kubeclient.load_config(inline_token_kubeconfig(tmp_path))
    cfg.host = "http://127.0.0.1:2"
    assert cfg.get_api_key_with_prefix("BearerToken") == "Bearer inline"
    assert cfg.host == "http://127.0.0.1:1"  # the hook ran: the kubeconfig's host again
    cfg.host = "http://127.0.0.1:2"
    assert cfg.get_api_key_with_prefix("BearerToken") == "Bearer inline"
    assert cfg.host == "http://127.0.0.1:2"  # within the second: not run (the throttle stays put)
