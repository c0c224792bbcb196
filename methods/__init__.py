"""The methods a researcher compares beside replay.py's strategies, each small and on its own:

  lookahead  several passes over one batch with drift control: SFPO's reposition, GXPO's
             extrapolation (lookahead.*)
"""
