import sys
def main(argv=None):
    from specdraft.config import load_config
    from specdraft.train.loop import train
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(argv[1], argv[2:])
    train(cfg)
    return 0
