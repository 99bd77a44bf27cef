"""Writers of one synthetic run in every format `nummon watch` reads (real writer packages:
torch's SummaryWriter, Lightning's CSVLogger, transformers' TrainerState, wandb offline)."""

import json
import math
import struct
from pathlib import Path

import numpy as np

LR = float(np.float32(1e-3))


def runaway_rows(healthy=40, runaway=16):
    """(step, loss, grad_norm) of a run that learns, then grows 4x per step, then goes NaN; every
    value exact in float32, so TensorBoard's float32 storage changes nothing."""
    rows = []
    loss, g = 2.0, 1.0
    for s in range(healthy):
        loss = 2.0 * 0.98**s * (1 + 0.02 * math.sin(1.7 * s))
        g = 1.0 + 0.1 * math.sin(s)
        rows.append((s, loss, g))
    for s in range(healthy, healthy + runaway):
        loss *= 4.0
        g *= 2.0
        rows.append((s, loss, g))
    rows.append((healthy + runaway, math.nan, math.inf))
    return [(s, float(np.float32(l)), float(np.float32(v))) for s, l, v in rows]


def write_jsonl(path, rows, with_alert_lines=True):
    """nummon's event-log shape: step lines, and alert lines that readers must skip."""
    from nummon._core.json import dumps

    with open(path, "w") as fh:
        for s, loss, g in rows:
            fh.write(dumps({"type": "step", "step": s, "loss": loss, "grad_norm": g, "lr": LR}) + "\n")
            if with_alert_lines and s % 10 == 9:
                fh.write(
                    dumps(
                        {
                            "type": "alert",
                            "step": s,
                            "kind": "stall",
                            "severity": "warning",
                            "metric": "loss",
                            "value": 1e9,
                        }
                    )
                    + "\n"
                )
    return path


def write_tensorboard(logdir, rows):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(logdir))
    for s, loss, g in rows:
        w.add_scalar("train/loss", loss, s)
        w.add_scalar("train/grad_norm", g, s)
        w.add_scalar("train/learning_rate", LR, s)
        w.add_scalar("eval/accuracy", 0.5, s)  # not mapped: ignored
    w.close()
    return logdir


def hf_history(rows, eval_every=10):
    hist = []
    for s, loss, g in rows:
        hist.append({"epoch": s / 100, "grad_norm": g, "learning_rate": LR, "loss": loss, "step": s})
        if s % eval_every == 0:
            hist.append({"epoch": s / 100, "eval_loss": 9.0, "eval_runtime": 0.1, "step": s})
    return hist


def write_hf_checkpoint(output_dir, rows, upto):
    """trainer_state.json of checkpoint-<upto>, as transformers writes it (bare NaN literals)."""
    from transformers.trainer_callback import TrainerState

    folder = Path(output_dir) / f"checkpoint-{upto}"
    folder.mkdir(parents=True, exist_ok=True)
    state = TrainerState(
        global_step=upto, max_steps=len(rows), log_history=hf_history([r for r in rows if r[0] <= upto])
    )
    state.save_to_json(str(folder / "trainer_state.json"))
    return folder / "trainer_state.json"


def write_hf_run(output_dir, rows, save_every=10):
    last = rows[-1][0]
    for upto in list(range(save_every, last, save_every)) + [last]:
        write_hf_checkpoint(output_dir, rows, upto)
    return output_dir


def csv_logger(save_dir):
    from lightning.fabric.loggers import CSVLogger

    return CSVLogger(str(save_dir), name="run", version=0, flush_logs_every_n_steps=1)


def write_csv(save_dir, rows):
    logger = csv_logger(save_dir)
    for s, loss, g in rows:
        logger.log_metrics({"train_loss": loss, "grad_norm": g, "lr-AdamW": LR}, step=s)
    logger.finalize("success")
    return Path(logger.log_dir) / "metrics.csv"


def write_wandb(rows, project="watch-test"):
    import wandb

    run = wandb.init(project=project, mode="offline")
    for s, loss, g in rows:
        run.log({"train/loss": loss, "train/grad_norm": g, "train/learning_rate": LR}, step=s)
    run.finish()
    wandb.teardown()  # finish() can return before the offline run file is complete
    files = sorted(Path(run.dir).parent.glob("run-*.wandb"))
    return files[-1]


def rows_json(rows):
    return json.dumps(rows)


# a minimal LevelDB-log writer for crafted W&B records (real files come from wandb itself)
def write_wandb_records(path, rows):
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    out = bytearray(b":W&B" + struct.pack("<H", 0xBEE1) + b"\x01")
    for items in rows:
        r = pb.Record()
        for k, v in items:
            it = r.history.item.add()
            it.key, it.value_json = k, v
        payload = r.SerializeToString()
        left = 32768 - len(out) % 32768
        if left < 7 + len(payload):
            out += b"\x00" * left
        crc = zlib.crc32(payload, zlib.crc32(bytes([1]))) & 0xFFFFFFFF
        out += struct.pack("<IHB", crc, len(payload), 1) + payload
    Path(path).write_bytes(bytes(out))
