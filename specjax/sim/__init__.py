"""specjax.sim"""
