"""A Hugging Face Qwen3-MoE with expert parallelism under DualPipeV, on 2 CPU ranks:
torchrun --standalone --nproc-per-node 2 examples/hf_moe_ep.py

Needs `pip install twinpipe[hf]`. The model is built from a small config with random weights (nothing
is downloaded). The ranks form a pipeline x expert-parallel mesh, here PP=1 x EP=2: each rank keeps
half of every MoE block's experts, token copies travel to their experts' ranks by all-to-all, and
the F&B ops of DualPipeV overlap those all-to-alls with the other micro-batch's compute. Each rank
trains on its own batch and prints its losses, which are the unsplit model's on that batch.
"""
import os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from twinpipe import hf
from twinpipe.hf.experts import shard_experts_
from twinpipe.hf.moe_layer import wrap_layer
from twinpipe.launch import init_torchrun_group
from twinpipe.moe import reduce_dense_grads

PP = 1                                      # pipeline ranks; EP = the ranks / PP
CHUNKS = 4                                  # micro-batches per step


def make_model():                           # the same weights on every rank
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config)


def batch(ep_rank, rows=8, seq=12):         # each EP rank its own token ids
    ids = torch.randint(1, 128, (rows, seq), generator=torch.Generator().manual_seed(ep_rank))
    return ids, torch.ones_like(ids), ids.clone()


def main():
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    pp, ep = PP, dist.get_world_size() // PP
    mesh = init_device_mesh("cpu", (pp, ep), mesh_dim_names=("pp", "ep"))
    pp_group, ep_group = mesh["pp"].get_group(), mesh["ep"].get_group()
    model = make_model()
    shard_experts_(model, ep_group)
    stages = hf.build(model, "dualpipev", wrap_layer=wrap_layer, process_group=pp_group)
    pipe = stages.pipeline(pp_group)
    params = list({id(p): p for m in stages.modules for p in m.parameters()}.values())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    inputs, labels = stages.batch(*batch(mesh.get_local_rank("ep")), num_chunks=CHUNKS)
    for step in range(2):
        loss, _ = pipe.step(*inputs, num_chunks=CHUNKS, criterion=stages.criterion, labels=labels)
        stages.sync_grads(pipe)             # mirrored copies and tied embeddings
        for m in stages.modules:
            reduce_dense_grads(m, ep_group)     # attention, router, norms: summed over the EP ranks
        optimizer.step(); optimizer.zero_grad()
        if loss is not None:                # the ranks with the last stage: one loss per micro-batch
            print(f"step {step}: rank {dist.get_rank()}: losses {loss.tolist()}")
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/hf_moe_ep.py`: start 2 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
