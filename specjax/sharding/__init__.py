"""specjax.sharding"""
