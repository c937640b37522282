"""The optional extras of pyproject.toml, and when a failure only means one is not installed."""

import importlib.util

# optional modules, each with the extra that installs it
OPTIONAL = {
    "cryptography": "secure",
    "transformers": "hf",
    "peft": "hf",
    "datasets": "hf",
    "tensorboard": "tensorboard",
    "opacus": "bench",
    "sklearn": "examples",
    "matplotlib": "examples",
    "mlxtend": "examples",
}


def missing_extra(error: BaseException | None) -> str | None:
    """The reason to skip when ``error`` (or what caused it) is an optional module not installed.

    Only a module of :data:`OPTIONAL` that this environment really lacks counts: an
    ImportError of anything else, or of an installed module, stays a failure.
    """
    while error is not None:
        if hasattr(error, "exc_info") and isinstance(error.exc_info, tuple):  # a doctest's
            error = error.exc_info[1]
        if isinstance(error, ImportError):
            name = (error.name or "").split(".")[0]
            if name in OPTIONAL and importlib.util.find_spec(name) is None:
                return f"needs the '{OPTIONAL[name]}' extra ({name} is not installed)"
        error = error.__cause__ or error.__context__
    return None


def missing_in_output(output: str) -> str | None:
    """The same reason for a subprocess whose ``output`` ends in a missing optional module."""
    for name, extra in OPTIONAL.items():
        if f"No module named '{name}" in output and importlib.util.find_spec(name) is None:
            return f"needs the '{extra}' extra ({name} is not installed)"
    return None
