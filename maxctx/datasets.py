"""The one table of dataset types: for each `dataset_type`, the source that reads it and the keys it needs.

The schema takes its choices from DATASETS (maxctx.config), validation its rules (maxctx.validate), and
maxctx.data.sources.make_source its reader. No JAX, no numpy: validation runs before either is imported.
"""

from __future__ import annotations

import dataclasses

FILE_GLOB = " (a file glob)"


@dataclasses.dataclass(frozen=True)
class Dataset:
    """How one dataset_type is read. `needs` and `eval_needs` pair a key that must be non-empty with the hint its
    error message gives; `eval_needs` apply when eval_interval > 0."""

    source: str = ""  # the class in maxctx.data.sources that reads documents; "": maxctx.data.synthetic
    split_keys: tuple[str, str] = ("", "")  # the keys naming the train and the eval split
    files: bool = False  # the split keys are file globs, matched to files before JAX starts
    needs: tuple[tuple[str, str], ...] = ()
    eval_needs: tuple[tuple[str, str], ...] = ()
    folder: tuple[str, str] = ("", "")  # a key naming a folder that must exist when set, and the fix if not
    ends: bool = True  # its eval split ends, so eval_steps=-1 can read it whole


_FILES = ("grain_train_files", "grain_eval_files")
DATASETS: dict[str, Dataset] = {
    "synthetic": Dataset(ends=False),
    "arrayrecord": Dataset("ArrayRecordSource", _FILES, files=True, needs=(("grain_train_files", FILE_GLOB),),
                           eval_needs=(("grain_eval_files", FILE_GLOB),)),
    "tfds": Dataset("TfdsSource", ("dataset_split", "eval_split"),
                    needs=(("dataset_name", ", e.g. dataset_name=my_dataset:1.0.0"),),
                    eval_needs=(("eval_split", " (e.g. eval_split=validation)"),),
                    folder=("tfds_data_dir", "give the folder TFDS prepared the dataset in, or leave it empty for "
                                             "TFDS's default")),
    "text": Dataset("TextSource", _FILES, files=True,
                    needs=(("grain_train_files", FILE_GLOB),
                           ("tokenizer_path", " (read as tokenizer_type; a sentencepiece model by default, which "
                                              "scripts/train_tokenizer.py trains)")),
                    eval_needs=(("grain_eval_files", FILE_GLOB),)),
}
