"""specjax.rl"""
