"""preflight: is the config valid, the tracking server there, the fabric fast enough?"""
