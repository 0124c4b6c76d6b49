s = f'{x!r:>{w}}' + rb'\' + '''
import n'''
