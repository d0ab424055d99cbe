"""A tiny random sentence-transformers encoder made on this machine (nothing can be downloaded): a
2-layer BERT of width 32 behind a WordLevel tokenizer trained on the given texts, mean pooling."""

from pathlib import Path


def make_tiny_encoder(root: Path, texts: list[str]) -> str:
    """Writes the encoder under `root`; returns its sentence-transformers directory."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import WordLevel
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.Lowercase(), pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", model_max_length=64).save_pretrained(root / "hf")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(root / "hf")
    transformer = Transformer(str(root / "hf"))
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(root / "st"))
    return str(root / "st")
