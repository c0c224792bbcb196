"""The methods a researcher compares beside replay.py's strategies, each small and on its own:

  greso      GRESO's prompt skipping (skip.*): prompts whose groups were flat are skipped
  stages     staged rollouts (stages.first): g1 samples first, the rest only where they teach
  gate       DGG's gradient gate on reuse passes (optim.gate)
  lookahead  several passes over one batch with drift control: SFPO's reposition, GXPO's
             extrapolation (lookahead.*)
"""
