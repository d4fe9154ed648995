"""The unit tier: in-process tests of each room (tests/unit/<room>/, mirroring webhook/<room>/), and at
the top the tests of the repository as a whole. The builders they share are in tests/harness/."""

from __future__ import annotations

from hypothesis import settings

# Property tests assert behaviour, not speed: on a loaded machine one example can take longer than
# hypothesis's default 200 ms deadline, which would fail a correct test. Timing lives in bench/.
settings.register_profile("gpuguard", deadline=None)
settings.load_profile("gpuguard")
