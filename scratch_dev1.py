"""Scratch (not committed): the new graph checks, then the same checks against the old single store."""
import sys
import torch
from cco.comm import Communicator
from cco.backends import cuda as C
from cco.preshuffle import unshuffle_b
from tests.python.cco import test_cuda_nn as T

comm = Communicator.from_env()
torch.cuda.set_device(comm.device)
log = (lambda *a: print(*a, flush=True)) if comm.rank == 0 else (lambda *a: None)
verdicts = []
for name, fn in (("preshuffled", T.check_preshuffled_copy_under_graphs), ("mxfp8", T.check_mxfp8_copy_under_graphs)):
    try:
        fn(comm, log); verdicts.append(f"fixed {name}: passed")
    except Exception as err:
        verdicts.append(f"fixed {name}: FAILED {err}")
    torch.cuda.synchronize(); comm.barrier()

def old_single_store(self, b_pre):  # the store before d7b6aa8: the last weight's copy, replaced on a miss
    if self.config.weight_layout == "row-major":
        return b_pre
    st = self.__dict__.setdefault("_old_store", {})
    key = (b_pre.data_ptr(), b_pre._version, b_pre.stride())
    if st.get("key") != key:
        value = unshuffle_b(b_pre)
        if C._not_capturing():
            st.update(key=key, value=value, alias=b_pre.detach())
        return value
    return st["value"]

C.CudaBackend._unshuffled = old_single_store
try:
    T.check_preshuffled_copy_under_graphs(comm, log); verdicts.append("broken (old store) preshuffled: passed (check did NOT catch it)")
except AssertionError as err:
    verdicts.append(f"broken (old store) preshuffled: failed as it must: {err}")
torch.cuda.synchronize(); comm.barrier()
log("\n".join(verdicts))
comm.close()
