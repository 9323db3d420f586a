"""Device, process-group backend and host-memory policy for one rank.

CUDA ranks use device cuda:LOCAL_RANK and the nccl backend; CPU ranks use the host and gloo.
Everything device-specific that the engine needs is asked of the Accelerator, so the stages never
branch on the device type themselves.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerator:
    """Where this rank computes and how it talks to other ranks.

    device: the torch.device holding parameters, gradients and (without offload) optimizer state.
    backend: the torch.distributed backend name for the data-parallel group ("nccl" or "gloo").
    """

    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock a host tensor so copies to the device can be asynchronous (CUDA only)."""
        if self.is_cuda and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def synchronize(self) -> None:
        """Wait for all queued device work (for timing; never needed for correctness)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def detect_accelerator(local_rank: int) -> Accelerator:
    """Pick cuda:local_rank with nccl when CUDA is available, else the CPU with gloo.

    Raises ValueError when CUDA is available but local_rank names no visible device.
    """
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible; "
                "start at most one rank per GPU or set CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_device(local_rank)
        return Accelerator(torch.device("cuda", local_rank), "nccl")
    return Accelerator(torch.device("cpu"), "gloo")
