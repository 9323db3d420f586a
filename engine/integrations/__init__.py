"""zero.integrations: doorways through which programs written for another library's API run on zero.

Owns: the DeepSpeed doorway (`zero-as-deepspeed COMMAND ...`; docs/migrating-from-deepspeed.md):
    deepspeed.py           the table of DeepSpeed module paths -> zero objects, the import finder
                           that serves `deepspeed` and those paths, DeepSpeed's small helpers
                           that have no other home, and the check for a real DeepSpeed shadowed
    placeholder.py         Placeholder: a DeepSpeed name zero does not implement, importable,
                           failing when used
    deepspeed_catalog.json DeepSpeed 0.19.8's every module path and public name (generated
                           from its source by tools/deepspeed_catalog.py), all of which resolve
    deepspeed_launcher.py  DeepSpeed's `deepspeed` launcher command, its flags mapped onto zrun
    doorway_cli.py         the zero-as-deepspeed command
    doorway/               what zero-as-deepspeed puts on PYTHONPATH and PATH: a thin `deepspeed`
                           package, its deepspeed-<version>.dist-info, and bin/deepspeed
Behaviour lives in zero's own modules; a doorway only maps names onto them.
May import: anything in zero (it is the top layer). Nothing in zero imports it.
"""
