"""The host machinery and device primitives every op uses; imports no kernel file. codes (named error / wait /
trace codes), device (jit: flags, bounded waits, peer pointers), schedule (the self-scheduling policy), runtime
(world, symmetric workspace, errors), planning (tiles, task tables), launch_plan (cached launches), descriptors
(host TMA descriptors). Design: docs/design/core.md."""
