"""Page tiles: (row, page) pairs grouped by page compute what each pair computes against its own copy of the page."""
import torch

from inference_engine.backends.torch.attention import page_pair_mix, page_pair_scores, page_tiles


def test_pairs_grouped_by_page_equal_each_pair_over_its_own_page():
    g = torch.Generator().manual_seed(0)
    n_pages, p, d, heads = 9, 8, 16, 3
    # skewed, as a prefill chunk's choices are: page 2 read by 50 pairs (four tiles of 16), pages 5 and 7 by none
    pair_page = torch.cat([torch.full((50,), 2), torch.tensor([0, 1, 3, 4, 6, 8, 8, 0, 3] * 3)])
    pair_page = pair_page[torch.randperm(pair_page.numel(), generator=g)]
    k = torch.randn(n_pages, p, d, generator=g)
    v = torch.randn(n_pages, p, d, generator=g)
    q = torch.randn(pair_page.numel(), heads, d, generator=g)
    w = torch.rand(pair_page.numel(), heads, p, generator=g)
    slot, tile_page = page_tiles(pair_page, n_pages, size=16)
    assert slot.unique().numel() == slot.numel()  # one grid row per pair
    assert torch.equal(tile_page, torch.tensor([0, 1, 2, 2, 2, 2, 3, 4, 6, 8]))  # ceil(count / 16) tiles per page read
    assert torch.equal(tile_page[slot // 16], pair_page)  # every pair sits in a tile of its own page
    want_s = torch.einsum("ngd,npd->ngp", q, k[pair_page])
    want_o = torch.einsum("ngp,npd->ngd", w, v[pair_page])
    torch.testing.assert_close(page_pair_scores(q, slot, tile_page, k, size=16), want_s)
    torch.testing.assert_close(page_pair_mix(w, slot, tile_page, v, size=16), want_o)
