"""One rank of ``test_hf_trainer_ddp``: ReMoETrainer under ``torch.distributed.run`` (gloo, CPU).

Writes ``rank<R>.json`` into ``sys.argv[1]``: per optimizer step the lambda used and the
sparsity the controller saw (all-reduced), this rank's own sparsity and token count (before
the all-reduce), the first lambda and its rule, and a checksum of the final weights.
"""

import json
import os
import sys

import torch
from transformers import TrainingArguments

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.hf.trainer import ReMoETrainer
from remoe.method.sparsity import step_statistics

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", num_experts=4))
g = torch.Generator().manual_seed(1)
rows = []
for i in range(32):
    ids = torch.randint(0, 512, (16,), generator=g)
    labels = ids.clone()
    labels[: i % 5] = -100  # uneven token counts per rank
    rows.append({"input_ids": ids, "labels": labels})
args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], save_strategy="no",
                         logging_steps=1, disable_tqdm=True, learning_rate=3e-3, max_steps=6,
                         per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         ddp_backend="gloo", seed=0, lr_scheduler_type="constant",
                         warmup_steps=0, dataloader_num_workers=0)
trainer = ReMoETrainer(model=model, args=args, train_dataset=rows)  # init_lambda="auto"
loop = trainer.remoe
steps = []
step_end = loop.step_end


def recording_step_end():
    sums = loop.control.sums  # this rank's micro-batches of the step, before the all-reduce
    tokens = float(sums.sums[3])  # (lm, reg, aux, tokens, micro-batches)
    local = step_statistics(sums.counts.cpu(), tokens).sparsity
    step_end()
    steps.append({"local_sparsity": local, "local_tokens": tokens, **loop.last})


loop.step_end = recording_step_end
trainer.train()
total = float(sum(p.detach().double().sum() for p in model.parameters()))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"steps": steps, "lambda_rule": loop.lambda_rule,
               "world": int(os.environ["WORLD_SIZE"]), "weights": total}, f)
