"""Tiny random encoders built in code (deterministic), saved to folders and loaded
through the real loading path: BERT, RoBERTa and XLM-RoBERTa base models, their
sequence-classification models (cross-encoders), and sentence-transformers folders
around them (a Pooling module, optionally Dense and Normalize)."""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_model import CORPUS, save_random_model


def wordpiece_tokenizer():
    """A BERT WordPiece tokenizer trained on the tiny corpus ([CLS] ... [SEP], pairs
    with token types)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, show_progress=False,
                           special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return BertTokenizerFast(tokenizer_object=wp._tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                             pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


def bpe_tokenizer():
    """A RoBERTa-style byte-level BPE tokenizer (<s> ... </s>)."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing
    from transformers import RobertaTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, show_progress=False,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe._tokenizer.post_processor = RobertaProcessing(("</s>", bpe.token_to_id("</s>")),
                                                      ("<s>", bpe.token_to_id("<s>")))
    return RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                sep_token="</s>", cls_token="<s>", unk_token="<unk>", pad_token="<pad>",
                                mask_token="<mask>")


def build_tiny_encoder(folder: Path, *, arch: str = "bert", task: str = "embed", num_labels: int = 1,
                       seed: int = 0, **overrides) -> Path:
    """A random ``arch`` ("bert", "roberta", "xlm-roberta") base model (``task``
    "embed") or sequence-classification model ("classify", ``num_labels`` labels)
    with its tokenizer in ``folder`` (made once)."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    tok = wordpiece_tokenizer() if arch == "bert" else bpe_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, pad_token_id=tok.pad_token_id)
    if arch != "bert":
        common.update(max_position_embeddings=130, type_vocab_size=1, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    if task == "classify":
        common.update(num_labels=num_labels, id2label={i: f"label_{i}" for i in range(num_labels)},
                      label2id={f"label_{i}": i for i in range(num_labels)})
    config = AutoConfig.for_model(arch, **{**common, **overrides})
    cls = AutoModelForSequenceClassification if task == "classify" else AutoModel
    save_random_model(folder, config, tok, seed, auto_class=cls)
    return folder


def build_sentence_transformer(folder: Path, base: Path, *, pooling: str = "mean", normalize: bool = True,
                               dense: int | None = None, max_seq_length: int | None = None,
                               lowercase: bool = False) -> Path:
    """A sentence-transformers folder (saved by sentence-transformers itself) of the
    model at ``base``: a Pooling module (``pooling``: "mean", "cls", "lasttoken"), then
    a Dense layer to ``dense`` features (tanh), then Normalize; ``lowercase``: its
    ``do_lower_case``."""
    folder = Path(folder)
    if (folder / "modules.json").exists():
        return folder
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers 6 moved its modules
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models

    transformer = models.Transformer(str(base), max_seq_length=max_seq_length)
    width = (transformer.get_embedding_dimension() if hasattr(transformer, "get_embedding_dimension")
             else transformer.get_word_embedding_dimension())
    modules = [transformer, models.Pooling(width, pooling_mode=pooling)]
    if dense is not None:
        torch.manual_seed(1)
        modules.append(models.Dense(width, dense, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    if lowercase:  # as sentence-transformers before 6 wrote it (and reads it still)
        import json

        path = folder / "sentence_bert_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "do_lower_case": True}))
    return folder
