"""scripts/research/paged_shortlist.py's early_stop count on a hand-made choice: a shortlisted page must be scored when
its bound reaches the recall_pages-th best exact page score, a page seen in part always is, and an exact score above
its bound is counted as a broken bound."""
import torch

from factories import load_script

INF = float("-inf")


def test_early_stop_counts_the_pages_an_exact_stop_would_still_score():
    ps = load_script("scripts/research/paged_shortlist.py")
    # one KV head, one query, 5 pages: pages 0-3 seen whole and shortlisted, page 4 seen in part (always scored)
    bound = torch.tensor([[[9.0, 7.0, 5.0, 2.0, INF]]])
    short = torch.tensor([[[True, True, True, True, True]]])
    whole = torch.tensor([[True, True, True, True, False]])
    pages_u = torch.tensor([[0, 1, 2, 3, 4]])
    exact = torch.tensor([[[6.0, 5.5, 3.0, 1.0, 4.0]]])  # recall_pages 2: the 2nd best exact score is 5.5
    c: dict = {}
    ps._early_stop(c, {"bound": bound, "short": short, "pages_u": pages_u, "page_scores": exact, "whole": whole}, 2)
    # bounds 9 and 7 reach 5.5 (scored), 5 and 2 do not (skipped), page 4 (part) is scored: 3 of 5
    assert (c["es_scored"], c["es_needed"], c["es_violations"], c["es_rows"]) == (5, 3, 0, 1)
    broken = exact.clone()
    broken[0, 0, 3] = 2.5  # above page 3's bound of 2
    ps._early_stop(c, {"bound": bound, "short": short, "pages_u": pages_u, "page_scores": broken, "whole": whole}, 2)
    assert c["es_violations"] == 1 and c["es_rows"] == 2
    # a head padded with page 0 (-inf in the pad) still sees page 0's real score above its bound
    padded = {"bound": torch.tensor([[[1.0, INF]]]), "short": torch.tensor([[[True, False]]]),
              "pages_u": torch.tensor([[0, 0]]), "page_scores": torch.tensor([[[2.0, INF]]]),
              "whole": torch.tensor([[True, True]])}
    ps._early_stop(c, padded, 1)
    assert c["es_violations"] == 2
