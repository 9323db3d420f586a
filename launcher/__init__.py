"""zero.launcher: ``zrun``, start a job with one process per slot on each selected host.

hostfile.py (hostfile, --include/--exclude) -> world.py (WorldLayout) -> runner.py (one agent
per node) -> agent.py (one process per slot, torch.distributed's elastic agent).
"""

import os
import sys
import time

from .cli import build_parser, resource_pool
from .runner import JobSpec, LocalRunner
from .world import build_layout

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run zrun with ``argv`` (default sys.argv[1:]); returns the process exit code.

    0 on success; the first failed rank's exit code (128 + N if it was killed by signal N);
    128 + N when zrun itself receives signal N; 2 for a usage error (bad flag or hostfile, missing
    hostfile, remote host while multi-node runners are not available yet), with one line on
    stderr.
    """
    args = build_parser().parse_args(argv)
    try:
        layout = build_layout(resource_pool(args), args.master_addr, args.master_port)
        job = JobSpec(
            script=args.script,
            script_args=tuple(args.script_args),
            run_id=f"zrun-{os.getpid()}-{int(time.time())}",
            module=args.module,
            no_python=args.no_python,
            no_local_rank=args.no_local_rank,
            log_dir=args.log_dir,
            shutdown_timeout=args.shutdown_timeout,
            verbose=args.verbose,
        )
        runner = LocalRunner(layout, job)
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        print(f"zrun: error: {error}", file=sys.stderr)
        return 2
    return runner.run()
