"""Fixtures shared by the chat's tests."""

import pytest

import macspec


@pytest.fixture(scope="module")
def chat_pair(chat_dirs):
    return macspec.load(*chat_dirs)
