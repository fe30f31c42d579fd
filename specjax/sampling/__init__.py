"""specjax.sampling"""
