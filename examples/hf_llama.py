"""A Hugging Face Llama on DualPipeV, 2 CPU ranks: torchrun --standalone --nproc-per-node 2 examples/hf_llama.py

Needs `pip install twinpipe[hf]`. The model is built from a small config with random weights (nothing
is downloaded); for a checkpoint, build it with `AutoModelForCausalLM.from_pretrained(folder)`.
"""
import os, sys
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig
from twinpipe import hf
from twinpipe.launch import init_torchrun_group

SCHEDULE = "dualpipev"


def make_model():                           # the same weights on every rank
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config)


def batch(step, rows=8):                    # a padded batch whose length changes from step to step
    g = torch.Generator().manual_seed(step)
    seq = 16 - 4 * (step % 2)
    ids = torch.randint(1, 128, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, :3] = 0                       # some rows left-padded
    labels = ids.masked_fill(mask == 0, -100)  # padding is not predicted
    return ids, mask, labels


def main():
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    rank, P = dist.get_rank(), dist.get_world_size()
    model = make_model()
    stages = hf.build(model, SCHEDULE, P, rank, layout="E,t|t|t|t,L" if P == 2 else None)
    if rank == 0:
        print(f"layout {stages.layout}, tied embeddings: {stages.tie}")
    pipe = stages.pipeline()                # a twinpipe.Pipeline; sequence lengths may change
    params = [p for m in stages.modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(list({id(p): p for p in params}.values()), lr=1e-3)
    for step in range(3):
        input_ids, attention_mask, labels = batch(step)  # every rank passes the whole batch
        inputs, labels = stages.batch(input_ids, attention_mask, labels, num_chunks=2 * P)
        loss, _ = pipe.step(*inputs, num_chunks=2 * P, criterion=stages.criterion, labels=labels)
        stages.sync_grads(pipe)             # mirrored copies and tied embeddings
        optimizer.step(); optimizer.zero_grad()
        if loss is not None:                # the rank with the last stage: one loss per micro-batch
            print(f"step {step}: loss {loss.sum().item():.4f}")  # their sum is the batch's mean token loss
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/hf_llama.py`: start 2 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
