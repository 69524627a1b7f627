"""`accelerate launch ... tests/fsdp_on_cpu.py SCRIPT ARGS...`: run SCRIPT with accelerate's FSDP plugin on CPU.

Accelerate applies its FSDP plugin only on accelerators (on CPU it falls back to DDP over gloo), while PyTorch's FSDP2
itself shards, gathers and reduce-scatters over gloo on CPU. This shim makes the one change: when accelerate was
launched with an FSDP config (ACCELERATE_USE_FSDP) and chose CPU DDP, its state becomes FSDP with the plugin the
config describes. Everything after (accelerate's fsdp2_prepare_model, the Trainer's FSDP paths, saving) is unchanged.
"""

import os
import runpy
import sys

import accelerate.state
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

_init = accelerate.state.AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    use_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if use_fsdp and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin()


accelerate.state.AcceleratorState.__init__ = _init_with_fsdp_on_cpu
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
