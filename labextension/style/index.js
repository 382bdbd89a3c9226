import './base.css';
import './rest.css';
