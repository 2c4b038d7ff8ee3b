"""Datasets and tokenizers: megatron-core's GPTDataset over indexed files, a generated
arithmetic corpus, a byte-level tokenizer and HF ``tokenizers`` files."""
