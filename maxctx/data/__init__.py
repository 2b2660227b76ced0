"""Input pipelines. Every source yields the same batch: a dict of [B, S] arrays

    inputs       int32   token ids fed to the model
    targets      int32   the next token of the same document (shift done on whole documents, before any reorder)
    positions    int32   position of the token inside its document (restarts at 0 for each packed document)
    segment_ids  int32   1, 2, ... per packed document in a row; 0 on padding
    weights      float32 loss weight: 1 on real targets, 0 on padding

laid out as x[B_(data,fsdp), S_(context,context_a2a)] global arrays, already in the zig-zag order when
context_parallel_load_balance is on and the context parallelism C > 1.

    pipeline.py        create_data_iterator: source -> tokenize -> pack -> zig-zag -> global arrays
    sources.py         ArrayRecord, TFDS and local text sources (random access, picklable)
    tokenizer.py       the tokenizer's checks, and documents -> (input, target) pairs
    tokenizer_types.py tokenizer_type readers: sentencepiece, tiktoken (Llama 3), huggingface (tokenizer.json)
    packing.py         first-fit and concat packing into rows with segment ids and positions
    synthetic.py       dataset_type=synthetic: learnable packed Markov-chain documents (with passkey documents)
    passkey.py         passkey documents: a key in a haystack, asked for at the end (evals, the synthetic mix)
    global_batch.py    per-host numpy batches -> global jax arrays
    prepare.py         offline: train a tokenizer, write tokenized ArrayRecord shards (scripts/)
"""

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")


class DataError(ValueError):
    """Bad input data (a corrupt record, an empty dataset, a document of zero tokens, ...): the message names the
    file or dataset and the record. Raised when the iterator is built or when a batch is drawn."""
