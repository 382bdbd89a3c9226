import { summarizeGpu } from '../src/gpuStatus';

const GiB = 2 ** 30;

describe('summarizeGpu', () => {
  it('says nothing when no kernel has GPU memory', () => {
    expect(
      summarizeGpu([
        { kernel_id: 'k', path: 'a.ipynb', state: 'running', gpu: null }
      ])
    ).toBeNull();
  });

  it('sums what is on the GPU and counts released and hibernated kernels', () => {
    const summary = summarizeGpu([
      {
        kernel_id: 'k1',
        path: 'd/a.ipynb',
        state: 'running',
        gpu: { where: 'gpu', bytes: 24 * GiB }
      },
      {
        kernel_id: 'k2',
        path: 'b.ipynb',
        state: 'running',
        gpu: { where: 'gpu', bytes: 8 * GiB }
      },
      {
        kernel_id: 'k3',
        path: 'c.ipynb',
        state: 'released',
        gpu: { where: 'host', bytes: 56 * GiB }
      },
      {
        kernel_id: 'k4',
        path: 'e.ipynb',
        state: 'hibernated',
        gpu: { where: 'store', bytes: 2 * GiB }
      },
      { kernel_id: 'k5', path: 'f.ipynb', state: 'running', gpu: null }
    ]);
    expect(summary).toEqual({
      text: 'GPU 32.0 GiB · 1 released · 1 hibernated',
      title:
        'a.ipynb: 24.0 GiB on the GPU\nb.ipynb: 8.00 GiB on the GPU\n' +
        'c.ipynb: 56.0 GiB released (host memory)\ne.ipynb: 2.00 GiB hibernated (store)'
    });
  });
});
