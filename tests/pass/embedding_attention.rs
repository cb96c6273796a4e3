//! embedding and attention: a one-block causal language model over token ids.
use memwise::prelude::*;

#[memwise::model(batch = 4, optimizer = adamw(lr = 3e-4, weight_decay = 0.1),
                 loss = sparse_categorical_crossentropy(logits, next_ids))]
struct TinyLm {
    #[input(shape = [128], dtype = i32)]
    ids: Input,
    #[input(shape = [128], dtype = i32)]
    next_ids: Input,
    #[embedding(input_dim = 1000, output_dim = 64, from = ids)]
    embed: Embedding,
    #[layer_norm]
    ln: LayerNorm,
    #[attention(num_heads = 4, causal = true, dropout = 0.1)]
    attn: Attention,
    #[add(embed, attn)]
    res: Add,
    #[dense(1000)]
    logits: Dense,
}

fn main() {
    use memwise::plan::LayerKind;
    let spec = TinyLm::spec();
    assert_eq!(
        spec.layer("embed").unwrap().kind,
        LayerKind::Embedding {
            vocab: 1000,
            dim: 64
        }
    );
    assert_eq!(
        spec.layer("attn").unwrap().kind,
        LayerKind::Attention {
            heads: 4,
            causal: true,
            dropout: 0.1
        }
    );
    assert_eq!(spec.loss[0].inputs, ["logits", "next_ids"]);
    // Table, QKV and output projections, layer norm, head.
    assert_eq!(
        TinyLm::PARAMS,
        64_000 + (64 * 192 + 192) + (64 * 64 + 64) + 128 + (64 * 1000 + 1000)
    );
}
