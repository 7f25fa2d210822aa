"""The remote reward client refuses a url or token it cannot use when it is built, never printing a secret."""

from __future__ import annotations

import secrets

import pytest
import torch

from flowrl.rewards import RewardError, build_multi_reward, ink
from flowrl.rewards.remote import RemoteReward, RemoteRewardError
from flowrl.rewards.server import TOKEN_ENV, RewardServer, check_token

URL = "http://127.0.0.1:8765"
SECRET = "s3cr3t-token"


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize(
    ("token", "kind"),
    [
        (SECRET + "\n", "a space or control character at position 13"),  # read from a file with its newline
        (SECRET + " ", "a space or control character at position 13"),
        ("s3cr3t\ttoken", "a space or control character at position 7"),
        (SECRET + "\x7f", "a space or control character at position 13"),
        ("ключ-" + SECRET, "a non-ASCII character at position 1"),
        ("café-" + SECRET, "a non-ASCII character at position 4"),
    ],
)
def test_a_token_no_http_client_can_send_is_refused_when_built_without_showing_it(token: str, kind: str) -> None:
    """It failed only at the first request, with UnicodeEncodeError or an error quoting 'Bearer TOKEN'."""
    with pytest.raises(ValueError, match=f"^remote reward option token has {kind}; .*visible ASCII") as info:
        RemoteReward(URL, token=token)
    assert SECRET not in one_line(info.value) and token.strip() not in str(info.value)


def test_a_token_from_the_environment_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, SECRET + "\n")
    with pytest.raises(ValueError, match=rf"^\${TOKEN_ENV} has a space or control character") as info:
        RemoteReward(URL)
    assert SECRET not in one_line(info.value)
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    assert RemoteReward(URL).token == SECRET
    monkeypatch.setenv(TOKEN_ENV, "")
    assert RemoteReward(URL).token is None  # empty: no token
    assert RemoteReward(URL, token="").token is None


def test_check_token_takes_visible_ascii_and_names_where_the_token_came_from() -> None:
    for token in (secrets.token_urlsafe(32), "a!#$%&'*+-.^_`|~=/", ""):
        check_token(token, "--token")
    with pytest.raises(ValueError, match="^--token has a space"):
        check_token("a b", "--token")
    with pytest.raises(TypeError, match="^rewards.judge.token must be a string .*; got int$"):
        check_token(123456, "rewards.judge.token")  # type: ignore[arg-type]


def test_a_request_that_cannot_be_encoded_never_quotes_the_authorization_header() -> None:
    """Even a token changed after the checks ends in a one-line RemoteRewardError without the token."""
    server = RewardServer(ink("bold"), "ink", host="127.0.0.1", port=0).start()
    try:
        client = RemoteReward(server.url, token=SECRET, retries=2, backoff_s=0.01)
        client.token = SECRET + "\n"
        with pytest.raises(RemoteRewardError, match="cannot be sent: a header or the url path holds") as info:
            client(torch.rand(2, 3, 8, 8), ["a", "b"])
        assert SECRET not in one_line(info.value)
        client.token = "ключ"
        with pytest.raises(RemoteRewardError, match="cannot be sent") as info:
            client.info()
        assert "ключ" not in one_line(info.value)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("http://127.0.0.1:notaport", "has port 'notaport', not a whole number in 1..65535"),
        ("http://127.0.0.1:99999", "has port '99999', not a whole number in 1..65535"),
        ("http://127.0.0.1:0", "has port '0', not a whole number in 1..65535"),
        ("http://[::1]:-1", "has port '-1'"),
        ("http://[::1", r"is not a URL \(Invalid IPv6 URL\); use e.g. http://127.0.0.1:8765"),
        ("http://:8765", "must look like http://127.0.0.1:8765 .*with a host"),
        ("ftp://127.0.0.1:8765", "must look like http://127.0.0.1:8765"),
        ("127.0.0.1:8765", "must look like http://127.0.0.1:8765"),
        ("http://127.0.0.1:8765?x=1", "must not have a query or fragment"),
        ("http://127.0.0.1:8765/#top", "must not have a query or fragment"),
        ("http://127.0.0.1:8765/score", "names the endpoint /score; give the server's base URL without it"),
        ("http://127.0.0.1:8765/reward/info/", "names the endpoint /info"),
        ("http://127.0.0.1:8765/my reward", "path has a space, control or non-ASCII character; percent-encode it"),
        ("http://127.0.0.1:8765/ключ", "path has a space, control or non-ASCII character"),
    ],
)
def test_a_url_the_client_cannot_use_is_refused_when_built(url: str, fragment: str) -> None:
    """Each failed only after sampling (e.g. 'reply is not HTTP (InvalidURL)', 'connection refused')."""
    with pytest.raises(ValueError, match=f"^remote reward option url {fragment}") as info:
        RemoteReward(url)
    one_line(info.value)


@pytest.mark.parametrize("userinfo", ["user:hunter2-pw@", "user@", ":hunter2-pw@"])
def test_a_password_in_the_url_is_refused_and_never_shown(userinfo: str) -> None:
    for url in (f"http://{userinfo}127.0.0.1:8765", f"http://{userinfo}[::1"):
        with pytest.raises(ValueError, match="^remote reward option url ") as info:
            RemoteReward(url)
        assert "hunter2" not in one_line(info.value)
    with pytest.raises(ValueError, match="holds a user name or password .*pass the secret as token"):
        RemoteReward(f"http://{userinfo}127.0.0.1:8765")


def test_usable_urls_are_kept() -> None:
    for url, kept in [
        ("http://127.0.0.1:8765", "http://127.0.0.1:8765"),
        ("http://127.0.0.1:65535/", "http://127.0.0.1:65535"),
        ("http://[::1]:8765/reward/", "http://[::1]:8765/reward"),
        ("https://rewards.example.com", "https://rewards.example.com"),  # no port: 443
        ("http://localhost:1/scores%20v2", "http://localhost:1/scores%20v2"),
        ("http://127.0.0.1:8765\n", "http://127.0.0.1:8765"),  # urlsplit drops tabs and newlines
    ]:
        assert RemoteReward(url).url == kept


def test_a_bad_url_stops_the_run_when_its_rewards_are_built() -> None:
    """The trainer builds its rewards before sampling: the bad port is named there, not 20 s later."""
    with pytest.raises(RewardError, match="remote reward option url has port 'notaport'"):
        build_multi_reward({"judge": {"reward": "remote", "url": "http://127.0.0.1:notaport"}})
    with pytest.raises(RewardError, match="remote reward option url has port '99999'"):
        build_multi_reward({"remote:http://127.0.0.1:99999": {"weight": 1.0}})
