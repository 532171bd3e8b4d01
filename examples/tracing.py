"""A traced DualPipeV step on 2 CPU ranks, written as a Chrome/Perfetto trace:
torchrun --standalone --nproc-per-node 2 examples/tracing.py

Every rank records when each of its ops ran (`trace=True`); `gather_timeline` aligns the ranks'
clocks and gathers the records on pipeline rank 0, which writes out/trace.json (open it in
https://ui.perfetto.dev) and prints its path.
"""
import os, sys
import torch, torch.distributed as dist
from torch import nn
import twinpipe
from twinpipe.launch import init_torchrun_group
from twinpipe.trace import gather_timeline, write_chrome_trace


def make_stage(i):                          # your model, cut into 2P stages
    torch.manual_seed(i)                    # the same weights on every rank
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh())


def crit(output, label):
    return nn.functional.mse_loss(output, label)


def main():
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    rank, P = dist.get_rank(), dist.get_world_size()
    pipe = twinpipe.DualPipeV([twinpipe.defer_weight_grads(make_stage(s))
                               for s in twinpipe.stages_of_rank("dualpipev", P, rank)])
    torch.manual_seed(0)
    inputs, labels = (torch.randn(32, 16),) if rank == 0 else (), (torch.randn(32, 16),) if rank == 0 else ()
    loss, _ = pipe.step(*inputs, num_chunks=8, criterion=crit, labels=labels, trace=True)
    timeline = gather_timeline(pipe, num_chunks=8)  # every rank calls it: it is a collective
    if timeline is not None:  # only on the rank that runs pipeline rank 0
        written = write_chrome_trace(timeline, "out/trace.json")
        print(f"losses {loss.tolist()}")
        print(f"wrote {written}: {len(timeline.slices)} slices on {P} ranks")
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/tracing.py`: start 2 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
