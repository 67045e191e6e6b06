"""What the training loop carries from step to step and saves in every checkpoint, besides the model, the optimizer
and the RNGs: the step, the data position and the counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from data.cursor import advance


@dataclass
class TrainState:
    """What the loop carries between steps and saves in every checkpoint (besides model, optimizer and RNG)."""

    step: int = 0
    batches_consumed: int = 0
    """Micro-batches this rank has drawn from its stream."""
    data_position: dict | None = None
    """Where this rank's data streams stand after the last micro-batch drawn (data/cursor.py), to resume from."""
    nonfinite_skipped: int = 0
    consecutive_nonfinite: int = 0
    corrupt_samples: int = 0
    shard_reads: int = 0
    """Shard reads the data workers of all ranks began (data/shard_read.py)."""
    skipped_shards: int = 0
    """Shard reads given up after the last try: the rest of the shard was skipped (`data/skipped_shards`)."""
    rollbacks: int = 0
    """Loss spikes rolled back so far (core/engine/rollback.py): kept across rollbacks and resumes."""
    best_top1: float = -1.0
    """Fine-tuning: the best `val/top1` so far (the weights in run_dir/export) and the step it was measured at, kept
    across a resume so that a worse evaluation never overwrites the exported best."""
    best_step: int = 0
    best_miou: float = -1.0
    """Segmentation fine-tuning's best `val/miou` so far, as `best_top1` is classification's (`best_step` its step)."""

    def state_dict(self) -> dict:
        """Every field: a field added to the class is saved and resumed (elastic resume included) with no other
        change."""
        return asdict(self)

    def consume(self, batch: dict) -> None:
        """Counts a micro-batch drawn from the stream and takes its stream's cursor (out of the batch) as the data
        position; a batch without one (a synthetic stand-in) leaves the position as it is."""
        self.batches_consumed += 1
        cursor = batch.pop("cursor", None)
        if cursor is not None:
            self.data_position = advance(self.data_position, cursor)

    def load_state_dict(self, state: dict) -> None:
        """Sets the fields `state` holds (a checkpoint from before a field existed keeps its default).

        Raises:
            ValueError: If `state` names a field this class does not have.
        """
        unknown = sorted(set(state) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(f"checkpoint train state has fields {unknown} that TrainState does not know")
        for name, value in state.items():
            setattr(self, name, value)
