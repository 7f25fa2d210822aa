"""The suite's network guard really blocks outside connections."""

import socket

import pytest


def test_outside_connection_is_blocked():
    with pytest.raises(RuntimeError, match="must stay offline"):
        socket.create_connection(("192.0.2.1", 443), timeout=1)


def test_hub_offline_is_set_for_tests():
    import os

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
