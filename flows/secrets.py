"""Tokens from Prefect Secret blocks: what a connection's `token_secret` names.

The engine cannot import Prefect, so `deliver-rule` hands `Chain.open()` this reader. It loads the
block anew for every chain: a token an operator changes in the UI (Blocks → Secret) is used by the
next chain, with no worker restarted. The value is returned to the engine and nothing else: it is
never logged, and the engine masks it in everything it writes, as it does a `token_env` token.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from prefect.blocks.system import Secret

log = logging.getLogger(__name__)


def read_secret_block(name: str) -> str | None:
    """The value of the Secret block `name`; None when there is no such block or it is empty (the
    chain then fails `MissingCredential`, naming the block). Any other error (the API is down, say)
    is raised as it is: it says nothing about the block, and it never carries the value."""
    try:
        # `_sync=True`: `deliver-rule` is an async flow, where Prefect would otherwise hand back a
        # coroutine; the chain opens synchronously, like its database reads.
        block = cast(Secret[Any], Secret.load(name, _sync=True))  # type: ignore[call-arg]
    except ValueError:  # Prefect's answer for "no block document of that name"
        log.debug("no Prefect Secret block named %r", name)
        return None
    value = block.get()
    if value is None or value == "":
        return None
    # A Secret may hold JSON (a dict, a number): the token is its text.
    return value if isinstance(value, str) else str(value)
