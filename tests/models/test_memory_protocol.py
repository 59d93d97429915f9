"""Every registered arch's memory state keeps the protocol the trainer relies on (models/README.md, "The memory
protocol"; the check is tests/support/memory_protocol.py)."""

import pytest

from memlm.models import ARCHITECTURES
from support.memory_protocol import check_memory_protocol


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_memory_state_keeps_the_protocol(name):
    check_memory_protocol(ARCHITECTURES[name])
