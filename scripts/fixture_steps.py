"""What the fixture scripts share: steps that record their failure and go
on (so one run reports every broken fixture), and a state dict copied into
plain contiguous tensors (as safetensors writes them)."""

import sys
import traceback

failures = []


def step(name):
    """Runs the decorated function, recording `name` if it raises."""
    def wrap(f):
        def run(*a, **k):
            try:
                return f(*a, **k)
            except Exception:
                failures.append(name)
                traceback.print_exc()
        return run
    return wrap


def contiguous(sd):
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def finish():
    """Exits non-zero, naming them, if any step failed."""
    if failures:
        print("FAILED:", failures)
        sys.exit(1)
