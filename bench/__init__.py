"""gpuguard's performance bench (issue 6): not part of the test suite; run it with `bench/run`."""
