"""Progress bars for start-up stages that can take a while (reading a large GGUF, packing a large model's
weights): shown only once a stage has run for PROGRESS_DELAY_S, so small models start without them."""
from tqdm.auto import tqdm

PROGRESS_DELAY_S = 2.0

__all__ = ["PROGRESS_DELAY_S", "tqdm"]
