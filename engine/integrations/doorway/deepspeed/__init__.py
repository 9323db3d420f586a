"""`deepspeed`, served by zero: zero-as-deepspeed puts this directory's parent on PYTHONPATH.

This package only hands over: zero.integrations.deepspeed replaces it in sys.modules with zero's
module for `deepspeed` and serves DeepSpeed's module paths (deepspeed.runtime.engine, ...) from
one table. See docs/migrating-from-deepspeed.md.
"""

try:
    from zero.integrations.deepspeed import install
except ImportError as error:
    raise ImportError(
        f"{__file__} is zero's DeepSpeed doorway (zero-as-deepspeed) and needs zero, which this "
        f"Python cannot import ({error}); run the command with the Python zero is installed in"
    ) from error

install(__file__)
